"""optimizer.name = "muon" through torchtitan's train specs, in one process (no torchrun).

Hooks (register.py), the container (builder.py), torchtitan's LR scheduler and the flattened
optimizer state dict torchtitan checkpoints with.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan")

import torchtitan.components.optimizer as tt_optim  # noqa: E402
import torchtitan.protocols.train_spec as tt_spec  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_optimizer_state_dict,
)
from torchtitan.config import ConfigManager  # noqa: E402

import muon_plugin.torchtitan  # noqa: E402

muon_plugin.torchtitan.activate()  # installs the hooks
from muon_plugin.torchtitan import register  # noqa: E402
from muon_plugin.torchtitan.builder import MuonOptimizersContainer022  # noqa: E402

PARALLEL_DIMS = SimpleNamespace(ep_enabled=False, pp_enabled=False)


def job_config(*args: str):
    return ConfigManager().parse_args(
        ["--job.custom_config_module", "muon_plugin.torchtitan", *args]
    )


def build_model(name: str, device: str = "cpu", flavor: str = "debugmodel") -> torch.nn.Module:
    from torchtitan.config import JobConfig

    spec = tt_spec.get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(JobConfig())
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.model_cls(args)
    if device != "meta":
        with torch.no_grad():
            model.init_weights()
    return model


def test_install_is_idempotent() -> None:
    dispatch, get_spec = tt_optim.build_optimizers, tt_spec.get_train_spec
    assert dispatch is register.build_optimizers
    register.install()
    register.install()
    assert tt_optim.build_optimizers is dispatch and tt_spec.get_train_spec is get_spec


def test_dense_and_moe_specs_route_muon() -> None:
    assert tt_spec.get_train_spec("llama3").build_optimizers_fn is register.build_optimizers
    assert tt_spec.get_train_spec("qwen3").build_optimizers_fn is register.build_optimizers
    # MoE specs keep their own builder (expert-bias hook); it calls the rebound module global
    moe_fn = tt_spec.get_train_spec("deepseek_v3").build_optimizers_fn
    assert moe_fn is tt_optim.build_optimizers_with_moe_load_balancing


def test_other_names_chain_to_torchtitan() -> None:
    model = build_model("llama3", "meta")
    cfg = job_config("--optimizer.name", "AdamW")
    opt = tt_spec.get_train_spec("llama3").build_optimizers_fn(
        [model], cfg.optimizer, PARALLEL_DIMS
    )
    assert type(opt) is tt_optim.OptimizersContainer
    assert isinstance(opt.optimizers[0], torch.optim.AdamW)
    with pytest.raises(NotImplementedError, match="Optimizer Lion not added"):
        register.build_optimizers([model], job_config("--optimizer.name", "Lion").optimizer, None)


def test_moe_builder_keeps_load_balancing_hook() -> None:
    model = build_model("deepseek_v3", "meta")
    cfg = job_config("--optimizer.name", "muon")
    build = tt_spec.get_train_spec("deepseek_v3").build_optimizers_fn
    opt = build([model], cfg.optimizer, PARALLEL_DIMS)
    assert isinstance(opt, MuonOptimizersContainer022)
    assert len(opt._optimizer_step_pre_hooks) == 1  # _update_expert_bias
    classes = opt.group_classes[0]
    assert classes[:3] == ["matrix", "expert", "router"]
    algorithms = [g["algorithm"] for g in opt.optimizers[0].param_groups]
    assert algorithms[:3] == ["muon", "muon", "adamw"]


def test_refuses_unsupported_modes() -> None:
    model = build_model("llama3", "meta")
    cfg = job_config("--optimizer.name", "muon", "--optimizer.early_step_in_backward")
    with pytest.raises(NotImplementedError, match="early_step_in_backward"):
        register.build_optimizers([model], cfg.optimizer, PARALLEL_DIMS)
    ft = SimpleNamespace(enabled=True)
    cfg = job_config("--optimizer.name", "muon")
    with pytest.raises(NotImplementedError, match="fault-tolerant"):
        register.build_optimizers([model], cfg.optimizer, PARALLEL_DIMS, ft)


def test_unmatched_pattern_fails_at_build() -> None:
    model = build_model("llama3", "meta")
    cfg = job_config("--optimizer.name", "muon", "--optimizer.muon.router_patterns", "*.gate.*")
    with pytest.raises(ValueError, match=r"router_patterns: pattern '\*\.gate\.\*' matches no"):
        register.build_optimizers([model], cfg.optimizer, PARALLEL_DIMS)


def test_container_steps_schedules_and_checkpoints() -> None:
    """One optimizer per part with all groups; torchtitan's LR scheduler keeps each group's lr
    ratio; the flattened state dict round-trips into a fresh container."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers

    cfg = job_config(
        "--optimizer.name",
        "muon",
        "--optimizer.lr",
        "1e-3",
        "--optimizer.muon.embedding_lr",
        "4e-3",
        "--optimizer.muon.norm_weight_decay",
        "0.0",
        "--lr_scheduler.warmup_steps",
        "2",
    )
    model = build_model("llama3")
    opt = tt_spec.get_train_spec("llama3").build_optimizers_fn(
        [model], cfg.optimizer, PARALLEL_DIMS
    )
    assert isinstance(opt, MuonOptimizersContainer022) and len(opt.optimizers) == 1
    inner = opt.optimizers[0]
    assert type(inner).__name__ == "MuonForeach"
    by = dict(zip(opt.group_classes[0], inner.param_groups, strict=True))
    assert set(by) == {"matrix", "embedding", "output", "norm"}
    assert by["matrix"]["lr_adjust"] == "match_rms_adamw"
    assert by["norm"]["wd"] == 0.0 and by["matrix"]["wd"] == cfg.optimizer.weight_decay
    assert by["matrix"]["adam_betas"] == (cfg.optimizer.beta1, cfg.optimizer.beta2)

    schedulers = build_lr_schedulers(opt, cfg.lr_scheduler, 10)
    tokens = torch.randint(0, 2048, (2, 33))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        schedulers.step()
    ratio = by["embedding"]["lr"] / by["matrix"]["lr"]
    assert ratio == pytest.approx(4.0)  # the scheduler scaled both by the same factor
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    wq = model.layers["0"].attention.wq.weight
    assert set(inner.state[wq]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(inner.state[model.tok_embeddings.weight])

    sd = opt.state_dict()
    assert "state.layers.0.attention.wq.weight.momentum_buffer" in sd
    assert "state.tok_embeddings.weight.exp_avg" in sd
    assert sd["param_groups.tok_embeddings.weight.lr"] == by["embedding"]["lr"]

    model2 = copy.deepcopy(model)
    opt2 = tt_spec.get_train_spec("llama3").build_optimizers_fn(
        [model2], cfg.optimizer, PARALLEL_DIMS
    )
    build_lr_schedulers(opt2, cfg.lr_scheduler, 10)  # as the Trainer does, before loading
    opt2.load_state_dict(sd)
    sd2 = get_optimizer_state_dict(
        model2, opt2.optimizers[0], options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    assert set(sd2) == set(sd)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(sd2[k], v, rtol=0, atol=0, msg=k)
        else:
            assert sd2[k] == v, k


def test_state_dtype_selects_low_precision_optimizer() -> None:
    try:
        from muon_plugin import MuonLP
    except (ImportError, AttributeError):
        pytest.skip("muon_plugin.MuonLP is not available")
    model = build_model("llama3", "meta")
    cfg = job_config("--optimizer.name", "muon", "--optimizer.muon.state_dtype", "bf16")
    opt = register.build_optimizers([model], cfg.optimizer, PARALLEL_DIMS)
    assert isinstance(opt.optimizers[0], MuonLP)
    assert opt.optimizers[0].state_dtype == "bf16"


def test_backend_option_reaches_every_muon_group() -> None:
    model = build_model("llama3", "meta")
    cfg = job_config("--optimizer.name", "muon", "--optimizer.muon.backend", "cublas")
    opt = register.build_optimizers([model], cfg.optimizer, PARALLEL_DIMS)
    groups = opt.optimizers[0].param_groups
    assert {g["backend"] for g in groups if g["algorithm"] == "muon"} == {"cublas"}
