"""torchtitan 0.3 configs with Muon: the llama3 debug model and the deepseek_v3 (MoE) debug model.

    scripts/train.sh configs/titan03_muon.py:llama3_debug_muon
    scripts/train.sh configs/titan03_muon.py:deepseek_v3_debug_muon --training.steps 5
    # = torchrun ... -m muon_plugin.torchtitan03.train --module configs.titan03_muon \
    #       --config llama3_debug_muon [--optimizer.muon.ns_steps 7 ...]

The Muon options come from the same TOML files the torchtitan 0.2.2 path uses
(``optimizer.muon_toml``: their ``[optimizer.muon]`` table), so both releases build the same
param groups. Data and tokenizer: scripts/prepare_data.py (``data/``, built by train.sh).
Runs on CPUs (gloo) through ``muon_plugin.torchtitan03.train``, unchanged on GPUs.
"""

from dataclasses import replace

from torchtitan.trainer import Trainer

from muon_plugin.torchtitan03.container import MuonOptimizersContainer


def _muon_job(config: Trainer.Config, *, name: str, lr: float, steps: int) -> Trainer.Config:
    """``config`` (a shipped debug config) with Muon, the local data and CPU-friendly sizes;
    every other setting of the shipped config (PP schedule, activation checkpointing, ...)
    is kept."""
    config.dump_folder = f"./outputs/{name}"
    config.hf_assets_path = "./data/tokenizer"
    config.optimizer = MuonOptimizersContainer.Config(
        lr=lr, weight_decay=0.1, eps=1e-8, muon_toml=f"configs/{name}.toml"
    )
    config.lr_scheduler = replace(
        config.lr_scheduler, warmup_steps=4, decay_ratio=0.5, decay_type="linear",
        min_lr_factor=0.1,
    )  # fmt: skip
    config.training = replace(
        config.training,
        local_batch_size=2,
        seq_len=256,
        steps=steps,
        max_norm=1.0,
        mixed_precision_param="float32",  # bf16 matmuls are slow on most CPUs
    )
    config.dataloader = replace(config.dataloader, dataset="c4_test", dataset_path="./data/corpus")
    config.metrics = replace(config.metrics, log_freq=1)
    # torchtitan 0.3's default "spmd_types" backend needs a newer torch for FSDP over
    # several processes; "partial_dtensor" works on every torch it runs with.
    config.parallelism = replace(config.parallelism, spmd_backend="partial_dtensor")
    config.checkpoint = replace(
        config.checkpoint, enable=False, folder="checkpoint", interval=10,
        last_save_model_only=False,
    )  # fmt: skip
    config.validator = replace(config.validator, enable=False)
    config.debug = replace(config.debug, seed=42)
    return config


def llama3_debug_muon() -> Trainer.Config:
    """llama3 debug model (dim 256, 6 layers), Muon + AdamW, 30 steps."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return _muon_job(llama3_debugmodel(), name="llama3_debug_muon", lr=1e-2, steps=30)


def deepseek_v3_debug_muon() -> Trainer.Config:
    """deepseek_v3 debug model (MoE: experts, router, shared experts), Muon + AdamW, 20 steps."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    return _muon_job(deepseek_v3_debugmodel(), name="deepseek_v3_debug_muon", lr=8e-3, steps=20)
