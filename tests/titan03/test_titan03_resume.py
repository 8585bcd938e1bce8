"""A torchtitan 0.3 resume keeps the job's Muon settings (the container loads through the
adapter core's pre-hook) and refuses another optimizer's state, in one process.

The checkpoint goes through DCP exactly as torchtitan 0.3's ``CheckpointManager.dcp_load``
loads it (the container and the LR schedulers as ``Stateful`` objects), with the llama3 debug
model (FlexAttention run eagerly, as the plugin's CPU mode runs it).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[2]
TOML = str(ROOT / "configs" / "llama3_debug_muon.toml")
STEPS, SPLIT = 4, 2


def llama3_debug() -> torch.nn.Module:
    from torchtitan.models.llama3 import model_registry

    from muon_plugin.torchtitan03.cpu_mode import eager_flex_attention_on_cpu

    eager_flex_attention_on_cpu()
    torch.manual_seed(0)
    model = model_registry("debugmodel").model.build()
    model.init_weights()
    return model


def build(model: torch.nn.Module, name: str = "muon", **muon: object):
    """The optimizers and LR schedulers a torchtitan 0.3 job builds for ``model``."""
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from muon_plugin.param_groups.options import MuonConfig
    from muon_plugin.torchtitan03.container import MuonOptimizersContainer

    if name == "muon":
        config = MuonOptimizersContainer.Config(lr=1e-2, muon=MuonConfig(**muon), muon_toml=TOML)
    else:
        config = default_adamw(lr=1e-2, fused=False)
    opt = config.build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=STEPS)
    return opt, sched


def train(model, opt, sched, steps: range) -> dict[int, float]:
    """Steps ``steps`` (their data fixed by the step number); the loss of each."""
    losses = {}
    for step in steps:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 2048, (2, 33), generator=g)
        opt.zero_grad()
        positions = torch.arange(32).expand(2, 32)
        masks = model.get_attention_masks(positions=positions)
        logits = model(tokens[:, :-1], positions, masks)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        losses[step] = loss.item()
    return losses


def dcp_load(states: dict, folder: Path) -> None:
    """torchtitan 0.3's ``CheckpointManager.dcp_load`` (with the plugin's check installed)."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    from muon_plugin.torchtitan import checkpoint

    checkpoint.install()
    manager = SimpleNamespace(states={}, sd_adapter=None)
    CheckpointManager.dcp_load(
        manager, states, checkpoint_id=str(folder), from_hf=False, from_quantized=False
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A run of STEPS steps, and its optimizer, schedulers and model at step SPLIT."""
    folder = tmp_path_factory.mktemp("titan03_resume") / f"step-{SPLIT}"
    model = llama3_debug()
    opt, sched = build(model)
    first = train(model, opt, sched, range(1, SPLIT + 1))
    dcp.save({"optimizer": opt, "lr_scheduler": sched}, checkpoint_id=str(folder))
    weights = copy.deepcopy(model.state_dict())
    rest = train(model, opt, sched, range(SPLIT + 1, STEPS + 1))
    return {"folder": folder, "weights": weights, "losses": {**first, **rest}}


def resume(saved: dict, **muon: object):
    model = llama3_debug()
    model.load_state_dict(saved["weights"])
    opt, sched = build(model, **muon)
    dcp_load({"optimizer": opt, "lr_scheduler": sched}, saved["folder"])
    return model, opt, sched


def test_unchanged_resume_continues_the_run_exactly(saved: dict, caplog) -> None:
    with caplog.at_level(logging.INFO):
        model, opt, sched = resume(saved)
    assert opt.changes_on_load == [] and "after loading the checkpoint" not in caplog.text
    got = train(model, opt, sched, range(SPLIT + 1, STEPS + 1))
    assert got == {s: saved["losses"][s] for s in got}


def test_changed_option_wins_changes_the_losses_and_is_logged(saved: dict, caplog) -> None:
    """The reproduction of the bug this guards against: a resume with ns_steps 1 had kept the
    checkpoint's 5 steps (step-4 loss bit-identical to an unchanged resume)."""
    with caplog.at_level(logging.INFO):
        model, opt, sched = resume(saved, ns_steps=1, momentum=0.9)
    by = dict(zip(opt.group_classes[0], opt.optimizers[0].param_groups, strict=True))
    assert by["matrix"]["ns_steps"] == 1 and by["matrix"]["momentum"] == 0.9
    assert "Muon: the job's settings replace the checkpoint's: " in caplog.text
    assert "ns_steps: 5 (checkpoint) -> 1 (job) in matrix, embedding, output, norm" in caplog.text
    assert "momentum: 0.95 (checkpoint) -> 0.9 (job) in matrix, embedding, output, norm" in (
        caplog.text
    )
    assert "Muon param groups after loading the checkpoint" in caplog.text
    assert any(c.startswith("ns_steps: 5 (checkpoint) -> 1 (job)") for c in opt.changes_on_load)
    # The LR schedule resumes where it was (torchtitan's scheduler state), for every group.
    assert sched.schedulers[0].last_epoch == SPLIT
    got = train(model, opt, sched, range(SPLIT + 1, STEPS + 1))
    assert got[SPLIT + 1] == saved["losses"][SPLIT + 1]  # the weights of step SPLIT
    assert got[STEPS] != saved["losses"][STEPS]  # the changed update of step SPLIT + 1


def test_changed_lr_is_logged_with_the_way_to_apply_it(saved: dict, caplog) -> None:
    model = llama3_debug()
    model.load_state_dict(saved["weights"])
    from torchtitan.components.optimizer import LRSchedulersContainer

    from muon_plugin.torchtitan03.container import MuonOptimizersContainer

    opt = MuonOptimizersContainer.Config(lr=5e-3, muon_toml=TOML).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=4)
    with caplog.at_level(logging.INFO):
        dcp_load({"optimizer": opt, "lr_scheduler": sched}, saved["folder"])
    assert "base lr differs from the checkpoint's (job 0.005, checkpoint 0.01 in matrix" in (
        caplog.text
    )
    assert "--checkpoint.exclude_from_loading lr_scheduler" in caplog.text


def test_checkpoint_of_another_optimizer_is_refused(tmp_path: Path) -> None:
    model = llama3_debug()
    adam, sched = build(model, name="AdamW")
    train(model, adam, sched, range(1, 2))
    dcp.save({"optimizer": adam}, checkpoint_id=str(tmp_path / "adamw"))
    muon, _ = build(copy.deepcopy(model))
    with pytest.raises(ValueError) as err:
        dcp_load({"optimizer": muon}, tmp_path / "adamw")
    message = str(err.value)
    assert "holds the state of another optimizer" in message
    assert "exp_avg, exp_avg_sq, step" in message and "needs momentum_buffer" in message
    assert "--checkpoint.exclude_from_loading optimizer,lr_scheduler" in message


def test_damaged_checkpoint_metadata_is_named(tmp_path: Path, saved: dict) -> None:
    import shutil

    folder = tmp_path / "damaged"
    shutil.copytree(saved["folder"], folder)
    metadata = folder / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:20])
    opt, _ = build(llama3_debug())
    with pytest.raises(ValueError, match="metadata file cannot be read .* incomplete or damaged"):
        dcp_load({"optimizer": opt}, folder)


def test_a_setting_newer_than_the_checkpoint_takes_the_jobs_value(saved: dict, caplog) -> None:
    """A group setting the checkpoint does not have (saved before the setting existed) loads
    with the job's value and one log line, instead of DCP's missing-key error."""
    model = llama3_debug()
    model.load_state_dict(saved["weights"])
    opt, sched = build(model)
    for g in opt.optimizers[0].param_groups:
        g["future_setting"] = 3
    with caplog.at_level(logging.INFO):
        dcp_load({"optimizer": opt, "lr_scheduler": sched}, saved["folder"])
    assert f"checkpoint {saved['folder']} has no future_setting setting" in caplog.text
    assert all(g["future_setting"] == 3 for g in opt.optimizers[0].param_groups)
    got = train(model, opt, sched, range(SPLIT + 1, STEPS + 1))
    assert got == {s: saved["losses"][s] for s in got}
