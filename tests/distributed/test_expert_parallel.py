"""Muon on the expert meshes and placements torchtitan 0.2.2 builds for expert parallelism.

torchtitan's MoE forward needs its GPU token-permutation kernels, but its parallelization does
not: each case builds torchtitan's own ``ParallelDims`` meshes and runs its own
``parallelize_deepseekv3`` (``ExpertParallel`` / ``ExpertTensorParallel`` on the experts,
FSDP2 over the ``efsdp`` mesh, HSDP, TP) on the deepseek_v3 debug model in gloo processes,
builds the optimizer through the model's train spec as a training run does, and with random
gradients laid out like the parameters checks that

- two steps equal one process's steps on the gathered gradients (bitwise for Muon);
- every rank orthogonalizes, sends and receives exactly what the plan says
  (:mod:`plan_accounting`);
- expert stacks whose matrices are whole on a rank move nothing; where FSDP shards the
  experts inside the matrix (more ``efsdp x ep`` ranks than experts: ``Shard(1)``) they are
  gathered, and HSDP splits them over its replicas.

World 4: EP 2 x FSDP 2, EP 4, HSDP 2 x EP 2, EP borrowing TP (FSDP 2 x TP 2, EP 2),
ETP (EP 2 x TP 2), and 2 experts on EP 2 x FSDP 2.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import device_type, run_distributed
from plan_accounting import (
    BACKEND,
    check_step_accounting,
    full,
    install_counting_backend,
    random_grads,
)

pytest.importorskip("torchtitan")

EP2 = dict(dp_replicate=1, dp_shard=4, tp=1, ep=2, etp=1)
EP4 = dict(dp_replicate=1, dp_shard=4, tp=1, ep=4, etp=1)
HSDP_EP = dict(dp_replicate=2, dp_shard=2, tp=1, ep=2, etp=1)
EP_TP = dict(dp_replicate=1, dp_shard=2, tp=2, ep=2, etp=1)
ETP = dict(dp_replicate=1, dp_shard=2, tp=2, ep=2, etp=2)
# (name, ParallelDims degrees, routed experts, the experts' placements, expert traffic)
CASES = [
    ("ep2-fsdp2", EP2, 8, {"(_S(0,2),S(0))"}, False),
    ("ep4", EP4, 8, {"(_S(0,4),S(0))"}, False),
    ("hsdp2-ep2", HSDP_EP, 8, {"(R,_S(0,2),S(0))"}, True),  # split over the replicas
    ("ep2-borrows-tp2", EP_TP, 8, {"(_S(0,2),S(0))"}, False),
    ("etp2-ep2", ETP, 8, {"(_S(0,2),S(0),S(1))", "(_S(0,2),S(0),S(2))"}, True),
    ("fsdp-inside-experts", EP2, 2, {"(S(1),S(0))"}, True),
]


def build(parallel: dict, experts: int, cli: list[str]):
    """The deepseek_v3 debug model made smaller (one dense and two MoE layers, narrower), unsharded,
    and its config. Small matrices keep one process's bf16 iteration bitwise equal to the
    owners' (larger CPU matmuls may round differently with the stack size)."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    cfg = ConfigManager().parse_args(cli)
    spec = get_train_spec("deepseek_v3")
    args = copy.deepcopy(spec.model_args["debugmodel"])
    args.update_from_config(cfg)
    args.n_layers, args.dim, args.inter_dim, args.moe_inter_dim = 3, 64, 96, 32
    args.n_heads, args.kv_lora_rank, args.qk_nope_head_dim = 4, 32, 16
    args.qk_rope_head_dim, args.v_head_dim = 8, 16
    args.moe_args.num_experts = experts
    args.moe_args.top_k = 1
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return spec, cfg, model


def run_case(ws, name, degrees, experts, placements, moves, backend) -> None:
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3

    from muon_plugin.torchtitan.builder import build_muon_optimizers

    cli = ["--job.custom_config_module", "muon_plugin.torchtitan", "--optimizer.name", "muon"]
    cli += ["--optimizer.muon.backend", BACKEND, "--activation_checkpoint.mode", "none"]
    cli += ["--training.mixed_precision_param", "float32", "--training.seq_len", "64"]
    cli += ["--parallelism.expert_parallel_degree", str(degrees["ep"])]
    cli += ["--parallelism.tensor_parallel_degree", str(degrees["tp"])]
    cli += ["--parallelism.expert_tensor_parallel_degree", str(degrees["etp"])]
    cli += ["--parallelism.data_parallel_replicate_degree", str(degrees["dp_replicate"])]
    spec, cfg, model = build(degrees, experts, cli)
    reference = copy.deepcopy(model)
    dims = ParallelDims(cp=1, pp=1, world_size=ws, **degrees)
    dims.build_mesh()
    parallelize_deepseekv3(model, dims, cfg)
    container = spec.build_optimizers_fn([model], cfg.optimizer, dims)
    ref_container = build_muon_optimizers([reference], cfg.optimizer, None)
    named = list(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    assert [n for n, _ in named] == list(ref_params), name
    for step in range(2):
        random_grads(named, step)
        for n, p in named:
            ref_params[n].grad = full(p.grad).detach().clone()
        report = check_step_accounting(container.optimizers, container.step, backend, name)
        ref_container.step()
    expert_rows = [r for r in report if len(r["shape"]) == 3]
    assert expert_rows and {r["placements"] for r in expert_rows} == placements, (
        name,
        expert_rows,
    )
    assert any(sum(r["send_bytes_per_rank"]) for r in expert_rows) == moves, (name, expert_rows)
    muon = {n for g in container.optimizers[0].param_groups if g["algorithm"] == "muon"
            for n in g["param_names"]}  # fmt: skip
    assert any(".moe.experts." in n for n in muon), name
    for n, p in named:
        got, want = full(p.detach()), ref_params[n].detach()
        if n in muon:
            assert torch.equal(got, want), f"{name}: {n} differs from one process"
        else:  # AdamW's CPU kernels may round shards of another length differently
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), f"{name}: {n}"


def job(rank: int, ws: int) -> None:
    import muon_plugin.torchtitan

    muon_plugin.torchtitan.activate()
    backend = install_counting_backend()
    for case in CASES:
        run_case(ws, *case, backend)


@pytest.mark.timeout(400)
def test_expert_parallel_layouts_world4():
    if device_type() != "cpu":
        pytest.skip("gloo only: the one-process reference is built on the CPU")
    run_distributed(job, 4)
