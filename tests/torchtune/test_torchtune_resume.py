"""A torchtune resume of the Muon component, in one process (a 1-rank gloo group, as the
recipe's loader needs): the config's settings win over the checkpoint's, lr included, and are
logged; another optimizer's state is refused by name on both of torchtune's resume paths.

The optimizer state goes through torchtune's own functions: the rank-0 full state dict
(``get_full_optimizer_state_dict`` / ``load_from_full_optimizer_state_dict``, the default path)
and a DCP folder (the ``enable_async_checkpointing`` path).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torchtune import config, training

from muon_plugin.torchtune import TorchtuneConfigError
from muon_plugin.torchtune.resume import check_resumed_state

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "torchtune_llama3_2_muon.yaml"
SPLIT, STEPS = 2, 4


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """torchtune's loader broadcasts from rank 0: a process group of one rank."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cfg():
    return OmegaConf.load(CONFIG)


def model_of(cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    return config.instantiate(cfg.model)


def muon(cfg, model, **overrides):
    section = OmegaConf.merge(cfg.optimizer, OmegaConf.create(overrides))
    return config.instantiate(section, list(model.named_parameters()))


def train(model, opt, steps: range) -> dict[int, float]:
    losses = {}
    for step in steps:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 128, (2, 17), generator=g)
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses[step] = loss.item()
    return losses


@pytest.fixture(scope="module")
def saved(cfg) -> dict:
    model = model_of(cfg)
    opt = muon(cfg, model)
    first = train(model, opt, range(1, SPLIT + 1))
    state = copy.deepcopy(training.get_full_optimizer_state_dict(model, opt, is_rank_zero=True))
    weights = copy.deepcopy(model.state_dict())
    rest = train(model, opt, range(SPLIT + 1, STEPS + 1))
    return {"state": state, "weights": weights, "losses": {**first, **rest}}


def resume(cfg, saved: dict, **overrides):
    model = model_of(cfg)
    model.load_state_dict(saved["weights"])
    opt = muon(cfg, model, **overrides)
    check_resumed_state(opt, saved["state"], None, "recipe_state.pt")
    training.load_from_full_optimizer_state_dict(
        model, opt, copy.deepcopy(saved["state"]), torch.device("cpu")
    )
    return model, opt


def test_unchanged_resume_continues_exactly(cfg, saved: dict, caplog) -> None:
    with caplog.at_level(logging.INFO):
        model, opt = resume(cfg, saved)
    assert "after loading the checkpoint" not in caplog.text
    got = train(model, opt, range(SPLIT + 1, STEPS + 1))
    assert got == {s: saved["losses"][s] for s in got}


def test_the_configs_settings_and_lr_win_and_are_logged(cfg, saved: dict, caplog) -> None:
    lr = float(cfg.optimizer.lr)
    with caplog.at_level(logging.INFO):
        model, opt = resume(cfg, saved, ns_steps=1, lr=lr / 2)
    matrix = next(g for g in opt.param_groups if g["algorithm"] == "muon")
    assert matrix["ns_steps"] == 1 and matrix["lr"] == lr / 2
    assert "Muon: the job's settings replace the checkpoint's: " in caplog.text
    assert "ns_steps: 5 (checkpoint) -> 1 (job) in matrix" in caplog.text
    assert f"lr: {lr:.3g} (checkpoint) -> {lr / 2:.3g} (job) in matrix" in caplog.text
    # torchtune then builds its LR scheduler from the groups' lr (initial_lr after a first
    # build): the config's lr is what the schedule scales.
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])
    get_cosine_schedule_with_warmup(opt, 0, 10, last_epoch=SPLIT - 1)
    assert matrix["lr"] == pytest.approx(
        lr / 2 * 0.5 * (1 + torch.cos(torch.tensor(0.2 * torch.pi)).item())
    )
    got = train(model, opt, range(SPLIT + 1, STEPS + 1))
    assert got[SPLIT + 1] == saved["losses"][SPLIT + 1] and got[STEPS] != saved["losses"][STEPS]


def _adamw_state(cfg) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """What torchtune's stock recipe trains: AdamW over ``model.parameters()``."""
    model = model_of(cfg)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, adamw, range(1, 2))
    return model, adamw


def test_another_optimizers_full_state_is_refused(cfg) -> None:
    model, adamw = _adamw_state(cfg)
    state = training.get_full_optimizer_state_dict(model, adamw, is_rank_zero=True)
    with pytest.raises(TorchtuneConfigError) as err:
        check_resumed_state(muon(cfg, model), state, None, "recipe_state.pt in out")
    message = str(err.value)
    assert message.startswith("checkpoint recipe_state.pt in out holds the state of another ")
    assert "for layers.0.attn.q_proj.weight it has exp_avg, exp_avg_sq, step" in message
    assert "needs momentum_buffer" in message and "resume_from_checkpoint: false" in message
    check_resumed_state(muon(cfg, model), None, None, "none")  # nothing to check


def test_another_optimizers_dcp_state_is_refused(cfg, tmp_path: Path) -> None:
    model, adamw = _adamw_state(cfg)
    dcp.save({"optimizer": adamw.state_dict()}, checkpoint_id=str(tmp_path / "dist_epoch_0"))
    with pytest.raises(TorchtuneConfigError, match="dist_epoch_0 holds the state of another"):
        check_resumed_state(muon(cfg, model), None, str(tmp_path / "dist_epoch_0"), "x")
    ours = muon(cfg, model)
    train(model, ours, range(1, 2))
    dcp.save({"optimizer": ours.state_dict()}, checkpoint_id=str(tmp_path / "dist_epoch_1"))
    check_resumed_state(muon(cfg, model), None, str(tmp_path / "dist_epoch_1"), "x")
