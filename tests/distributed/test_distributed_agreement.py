"""Ranks that disagree on the Muon parameter list fail with one clear error, at every step.

Spawned gloo processes (world sizes 2 and 4, FSDP2 ``Shard(0)``, a 2 x 2 mesh, plain tensors
under ``replicate_group``): a group in another order on one rank, another set of same-size
parameters with gradients, an extra parameter on one rank, another setting on one rank: every
rank raises the same ``RankDisagreementError`` naming the parameter and the ranks. An agreeing
setup steps like one process, also after its plan is rebuilt, and the rebuilt plan is checked
again. A gradient that goes None on one rank only after a step (that rank alone would rebuild
its plan while its peers run their cached one) fails within the step on every rank, by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import GPU_UPDATE_RTOL, device_type, exact, run_distributed, update_difference
from test_distributed import Mats, full, set_random_grads
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from muon_plugin import Muon, MuonForeach
from muon_plugin.distributed import RankDisagreementError
from muon_plugin.distributed.agreement import disagreement_message

SHAPES = {"a": (8, 6), "b": (8, 6), "c": (12, 6)}
KWARGS = dict(lr=0.02, wd=0.1, momentum=0.9)


# ------------------------------------------------------- shared functions (in workers)


def fsdp_params(ws: int, seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    model = Mats(SHAPES, seed=seed)
    fully_shard(model, mesh=init_device_mesh(device_type(), (ws,)))
    return list(model.named_parameters())


def group_of(named: list[tuple[str, nn.Parameter]], **options) -> dict:
    return {"params": [p for _, p in named], "param_names": [n for n, _ in named], **options}


def expect_same_error(opt, pattern: str) -> None:
    """``opt.step()`` raises RankDisagreementError matching ``pattern``, the same on every rank."""
    with pytest.raises(RankDisagreementError, match=pattern) as info:
        opt.step()
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, messages


def last_rank_swaps(rank: int, ws: int, named: list) -> list:
    """The last rank lists ``b`` before ``a`` (as a group built from a set might)."""
    return [named[1], named[0], *named[2:]] if rank == ws - 1 else named


# ---------------------------------------------------------------------- cases


def case_reordered(rank: int, ws: int, driver) -> None:
    named = fsdp_params(ws)
    opt = driver([group_of(last_rank_swaps(rank, ws, named))], **KWARGS)
    set_random_grads(named, 0)
    others = "rank 0" if ws == 2 else rf"ranks \[{', '.join(map(str, range(ws - 1)))}\]"
    expect_same_error(
        opt, rf"different order: position 0 is 'a' on {others}, 'b' on rank {ws - 1} "
    )


def case_different_set(rank: int, ws: int, driver) -> None:
    """Same sizes: rank 0 has a gradient on ``a``, the others on ``b``."""
    named = fsdp_params(ws)
    opt = driver([group_of(named)], **KWARGS)
    set_random_grads(named, 0)
    dict(named)["b" if rank == 0 else "a"].grad = None
    expect_same_error(opt, r"parameter 'a' \(global shape \(8, 6\)\) is given on rank 0 but not")


def case_different_set_unnamed(rank: int, ws: int, driver) -> None:
    """Without ``param_names`` parameters are named by group position, not step position."""
    named = fsdp_params(ws)
    opt = driver([{"params": [p for _, p in named]}], **KWARGS)
    set_random_grads(named, 0)
    dict(named)["b" if rank == 0 else "a"].grad = None
    expect_same_error(opt, r"parameter 'group 0 #0' .* is given on rank 0 but not")


def case_extra_param(rank: int, ws: int, driver) -> None:
    """Different sizes: only the last rank has a gradient on ``c``."""
    named = fsdp_params(ws)
    opt = driver([group_of(named)], **KWARGS)
    set_random_grads(named, 0)
    if rank != ws - 1:
        dict(named)["c"].grad = None
    expect_same_error(opt, rf"parameter 'c' .* is given on rank {ws - 1} but not on ranks \[0")


def case_setting(rank: int, ws: int, driver) -> None:
    named = fsdp_params(ws)
    opt = driver([group_of(named, ns_steps=6 if rank == 1 else 5)], **KWARGS)
    set_random_grads(named, 0)
    expect_same_error(opt, r"parameter 'a' \(position 0\) differs in settings .*steps=6.* rank 1")


def case_mesh_2x2(rank: int, ws: int, driver) -> None:
    """Shard(0) x Shard(1) on a 2 x 2 mesh: the ranks of both mesh dims take part."""
    mesh = init_device_mesh(device_type(), (2, 2))
    model = Mats(SHAPES, seed=1)
    named = [
        (n, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0), Shard(1)])))
        for n, p in model.named_parameters()
    ]
    opt = driver([group_of(last_rank_swaps(rank, ws, named))], **KWARGS)
    set_random_grads(named, 0)
    expect_same_error(opt, r"position 0 is 'a' on ranks \[0, 1, 2\], 'b' on rank 3 ")


def case_replicated_plain(rank: int, ws: int, driver) -> None:
    """Plain tensors replicated over ``replicate_group`` (DDP) are split over it: checked too."""
    named = list(Mats(SHAPES, seed=3).named_parameters())
    group = group_of(last_rank_swaps(rank, ws, named))
    opt = driver([group], replicate_group=dist.group.WORLD, **KWARGS)
    set_random_grads(named, 0)
    expect_same_error(opt, rf"position 0 is 'a' on rank 0, 'b' on rank {ws - 1} ")


def case_agree_then_rebuild(rank: int, ws: int, driver) -> None:
    """Agreeing ranks match one process, also after a rebuild; a rebuild is checked again."""
    named = fsdp_params(ws, seed=2)
    ref_named = [(n, nn.Parameter(full(p).detach().clone())) for n, p in named]
    init = [q.detach().clone() for _, q in ref_named]
    opt = driver([group_of(named)], **KWARGS)
    ref = driver([group_of(ref_named)], **KWARGS)
    for step, dropped in ((0, ()), (1, ("c",))):  # step 1: every rank drops c's gradient
        set_random_grads(named, step)
        for (n, p), (_, q) in zip(named, ref_named, strict=True):
            p.grad = None if n in dropped else p.grad
            q.grad = None if n in dropped else full(p.grad).detach().clone()
        opt.step()
        ref.step()
        for (n, p), (_, q), q0 in zip(named, ref_named, init, strict=True):
            got = full(p.detach())
            if exact():
                assert torch.equal(got, q.detach()), (step, n)
            else:
                assert update_difference(got, q.detach(), q0) <= GPU_UPDATE_RTOL, (step, n)
    # Step 2: a rebuilt plan on disagreeing ranks (rank 0 drops a, the others b).
    set_random_grads(named, 2)
    dict(named)["a" if rank == 0 else "b"].grad = None
    expect_same_error(opt, r"parameter 'b' .* is given on rank 0 but not")


def case_one_rank_drops_a_gradient_after_a_step(rank: int, ws: int, driver) -> None:
    """Step 0 agrees (every rank caches its plan); at step 1 only the last rank has no
    gradient on ``c``: its list changes while its peers' cached plans would run unchanged."""
    named = fsdp_params(ws, seed=4)
    opt = driver([group_of(named)], **KWARGS)
    set_random_grads(named, 0)
    opt.step()
    set_random_grads(named, 1)
    if rank == ws - 1:
        dict(named)["c"].grad = None
    others = "rank 0" if ws == 2 else rf"ranks \[{', '.join(map(str, range(ws - 1)))}\]"
    expect_same_error(opt, rf"parameter 'c' .* is given on {others} but not on rank {ws - 1}")


def job_world2(rank: int, ws: int) -> None:
    case_reordered(rank, ws, Muon)
    case_different_set(rank, ws, MuonForeach)
    case_different_set_unnamed(rank, ws, Muon)
    case_replicated_plain(rank, ws, MuonForeach)
    case_agree_then_rebuild(rank, ws, Muon)
    case_one_rank_drops_a_gradient_after_a_step(rank, ws, MuonForeach)


def job_world4(rank: int, ws: int) -> None:
    case_reordered(rank, ws, MuonForeach)
    case_different_set(rank, ws, Muon)
    case_extra_param(rank, ws, MuonForeach)
    case_setting(rank, ws, Muon)
    case_mesh_2x2(rank, ws, Muon)
    case_agree_then_rebuild(rank, ws, MuonForeach)
    case_one_rank_drops_a_gradient_after_a_step(rank, ws, Muon)


@pytest.mark.timeout(200)
def test_disagreeing_ranks_world2():
    run_distributed(job_world2, 2)


@pytest.mark.timeout(200)
def test_disagreeing_ranks_world4():
    run_distributed(job_world4, 4)


# ---------------------------------------------------------------------- the message alone


def entry(name: str, shape=(8, 6), placements="(Shard(dim=0),)", settings="s") -> tuple:
    return (name, repr(shape), "torch.float32", "ranks [0, 1] of shape (2,)", placements, settings)


def test_message_names_what_differs():
    a, b = entry("a"), entry("b")
    msg = disagreement_message([0, 1], [("h", [a, b]), ("h", [b, a])])
    assert "position 0 is 'a' on rank 0, 'b' on rank 1" in msg
    msg = disagreement_message([0, 1, 2], [("h", [a]), ("h", [a, b]), ("h", [a])])
    assert "parameter 'b' (global shape (8, 6)) is given on rank 1 but not on ranks [0, 2]" in msg
    assert "rank 0: 1, rank 1: 2, rank 2: 1" in msg
    msg = disagreement_message([0, 1], [("h", [a]), ("h", [entry("a", (6, 8), "(Shard(dim=1),)")])])
    assert "parameter 'a' (position 0) differs in global shape (8, 6) on rank 0, (6, 8)" in msg
    assert "placements (Shard(dim=0),) on rank 0, (Shard(dim=1),) on rank 1" in msg
    assert "dtype" not in msg.split("differs in")[1]
    msg = disagreement_message([0, 1], [("batched", [a]), ("unbatched", [a])])
    assert "optimizer settings differ: batched on rank 0, unbatched on rank 1" in msg
