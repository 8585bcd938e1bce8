"""torchtitan 0.2.2 plugin: resumes keep the job's settings, checkpoints of another optimizer,
errors naming their keys, a ``None`` optimizer config, the end-of-run summary (one process)."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan")

import torch.distributed.checkpoint as dcp  # noqa: E402
import torchtitan.components.checkpoint as tt_ckpt  # noqa: E402
import torchtitan.protocols.train_spec as tt_spec  # noqa: E402
from torchtitan.components.lr_scheduler import build_lr_schedulers  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

import muon_plugin.torchtitan  # noqa: E402,F401  (installs the hooks)
from muon_plugin.errors import SettingError  # noqa: E402
from muon_plugin.torchtitan import register  # noqa: E402
from muon_plugin.torchtitan.builder import with_config_key  # noqa: E402
from muon_plugin.torchtitan.summary import install_on  # noqa: E402

PARALLEL_DIMS = SimpleNamespace(ep_enabled=False, pp_enabled=False)
STEPS = 10


def job_config(*args: str):
    return ConfigManager().parse_args(
        [
            "--job.custom_config_module",
            "muon_plugin.torchtitan",
            "--lr_scheduler.warmup_steps",
            "2",
            "--training.steps",
            str(STEPS),
            *args,
        ]
    )


def tiny_model() -> torch.nn.Module:
    from torchtitan.config import JobConfig

    spec = tt_spec.get_train_spec("llama3")
    args = copy.deepcopy(spec.model_args["debugmodel"])
    args.update_from_config(JobConfig())
    args.n_layers, args.dim, args.vocab_size = 1, 64, 128
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return model


def build(model: torch.nn.Module, *args: str):
    cfg = job_config(*args)
    opt = tt_spec.get_train_spec("llama3").build_optimizers_fn(
        [model], cfg.optimizer, PARALLEL_DIMS
    )
    return opt, build_lr_schedulers(opt, cfg.lr_scheduler, STEPS)


def train(model, opt, sched, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 128, (2, 9))
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        sched.step()


def checkpoint(*args: str) -> tuple[torch.nn.Module, dict, dict]:
    model = tiny_model()
    opt, sched = build(model, *args)
    train(model, opt, sched, 3)
    return model, copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())


def resume(model, opt_sd, sched_sd, *args: str):
    model = copy.deepcopy(model)
    opt, sched = build(model, *args)
    opt.load_state_dict(copy.deepcopy(opt_sd))
    sched.load_state_dict(copy.deepcopy(sched_sd))
    return model, opt, sched


def test_resume_keeps_the_jobs_settings_and_the_scheduled_lr(caplog) -> None:
    model, opt_sd, sched_sd = checkpoint("--optimizer.name", "muon")
    changed = (
        "--optimizer.muon.ns_steps", "7", "--optimizer.weight_decay", "0.2",
        "--optimizer.muon.norm_weight_decay", "0.05", "--optimizer.lr", "5e-3",
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        _, opt, sched = resume(model, opt_sd, sched_sd, "--optimizer.name", "muon", *changed)
    by = dict(zip(opt.group_classes[0], opt.optimizers[0].param_groups, strict=True))
    assert by["matrix"]["ns_steps"] == 7
    assert by["matrix"]["wd"] == 0.2 and by["embedding"]["wd"] == 0.2
    assert by["norm"]["wd"] == 0.05
    assert "ns_steps: 5 (checkpoint) -> 7 (job) in matrix, embedding, output, norm" in caplog.text
    assert "wd: 0.1 (checkpoint) -> 0.2 (job) in matrix, embedding, output" in caplog.text
    assert "wd: 0.1 (checkpoint) -> 0.05 (job) in norm" in caplog.text
    assert "base lr differs from the checkpoint's (job 0.005, checkpoint 0.0008 in matrix," in (
        caplog.text
    )
    assert "the LR scheduler resumes from the checkpoint's base lr" in caplog.text
    assert "Muon param groups after loading the checkpoint" in caplog.text
    table = caplog.text.split("after loading the checkpoint:")[1]
    norm_row = next(line for line in table.splitlines() if line.startswith("norm"))
    assert norm_row.split()[-1] == "0.05"

    # lr: exactly what torchtitan does for AdamW, the saved base lr and schedule position.
    muon_lrs = [by["matrix"]["lr"]]
    _, adam_sd, adam_sched_sd = checkpoint("--optimizer.name", "AdamW")
    _, adam, adam_sched = resume(model, adam_sd, adam_sched_sd, "--optimizer.lr", "5e-3")
    adam_lrs = [adam.optimizers[0].param_groups[0]["lr"]]
    for o, s, lrs in ((opt, sched, muon_lrs), (adam, adam_sched, adam_lrs)):
        s.step()
        lrs.append(o.optimizers[0].param_groups[0]["lr"])
    assert muon_lrs == pytest.approx(adam_lrs)
    assert muon_lrs[1] == pytest.approx(8e-4 * sched.schedulers[0].lr_lambdas[0](4))


def test_unchanged_resume_logs_nothing(caplog) -> None:
    model, opt_sd, sched_sd = checkpoint("--optimizer.name", "muon")
    with caplog.at_level(logging.INFO):
        _, opt, _ = resume(model, opt_sd, sched_sd, "--optimizer.name", "muon")
    assert opt.changes_on_load == []
    assert "after loading the checkpoint" not in caplog.text


def _dcp_load(states: dict, folder: str) -> None:
    manager = SimpleNamespace(states={}, sd_adapter=None)
    tt_ckpt.CheckpointManager.dcp_load(
        manager, states, checkpoint_id=folder, from_hf=False, from_quantized=False
    )


def test_checkpoint_of_another_optimizer_is_refused_with_the_flag(tmp_path) -> None:
    model = tiny_model()
    adam, sched = build(model, "--optimizer.name", "AdamW")
    train(model, adam, sched, 1)
    dcp.save({"optimizer": adam}, checkpoint_id=str(tmp_path / "adamw"))
    muon, _ = build(copy.deepcopy(model), "--optimizer.name", "muon")
    with pytest.raises(ValueError) as err:
        _dcp_load({"optimizer": muon}, str(tmp_path / "adamw"))
    message = str(err.value)
    assert "holds the state of another optimizer" in message
    assert "exp_avg, exp_avg_sq, step" in message and "needs momentum_buffer" in message
    assert "optimizer.name = 'muon'" in message
    assert "--checkpoint.exclude_from_loading optimizer,lr_scheduler" in message

    # The other way round too; and a Muon checkpoint loads into Muon.
    train(model, muon, _, 1)
    dcp.save({"optimizer": muon}, checkpoint_id=str(tmp_path / "muon"))
    with pytest.raises(ValueError, match="needs exp_avg, exp_avg_sq, step"):
        _dcp_load({"optimizer": adam}, str(tmp_path / "muon"))
    again, _ = build(copy.deepcopy(model), "--optimizer.name", "muon")
    _dcp_load({"optimizer": again}, str(tmp_path / "muon"))


def test_errors_name_the_job_key() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"^optimizer\.lr: invalid value -1\.0"):
        build(model, "--optimizer.name", "muon", "--optimizer.lr=-1")
    with pytest.raises(ValueError, match=r"^optimizer\.beta2: invalid value 1\.5"):
        build(model, "--optimizer.name", "muon", "--optimizer.beta2", "1.5")
    # The optimizer's errors carry their key; the job's spelling comes from a table.
    e = with_config_key(SettingError("lr", "lr must be a number >= 0, got -1"))
    assert str(e).startswith("optimizer.lr (or optimizer.muon.<class>_lr): lr must")
    e = with_config_key(SettingError("momentum", "momentum must be in [0, 1), got 2"))
    assert str(e).startswith("optimizer.muon.momentum: ")
    e = with_config_key(SettingError("adam_betas", "adam_betas must be two numbers in [0, 1)"))
    assert str(e).startswith("optimizer.beta1 / optimizer.beta2")
    e = with_config_key(ValueError("no key"))  # an error that names no setting: the section
    assert str(e) == "optimizer.muon: no key"


def test_custom_builder_with_a_none_config() -> None:
    calls = []

    def custom(model_parts, optimizer_config, parallel_dims, ft_manager, hook):
        calls.append(hook)
        return "built"

    wrapped = register.with_muon(spec_with_builder(custom)).build_optimizers_fn
    assert wrapped([tiny_model()], None, None, None, "h") == "built" and calls == ["h"]
    assert register.build_optimizers.__name__ == "build_optimizers"


def spec_with_builder(fn):
    from torchtitan.protocols.train_spec import TrainSpec

    base = tt_spec.get_train_spec("llama3")
    return TrainSpec(**{**base.__dict__, "build_optimizers_fn": fn})


class FakeProcessor:
    def __init__(self, skipped: int, job_config) -> None:
        self.job_config = job_config
        self.optimizers = [SimpleNamespace(skipped_updates=skipped)]
        self.device_memory_monitor = SimpleNamespace(
            get_peak_stats=lambda: SimpleNamespace(max_reserved_gib=1.5)
        )
        self.logged, self.closed = [], False

    def log(self, step, loss, max_loss, grad_norm, extra_metrics=None):
        self.logged.append(step)

    def close(self):
        self.closed = True


def test_summary_and_skip_count(caplog, tmp_path) -> None:
    cfg = job_config("--job.dump_folder", str(tmp_path), "--checkpoint.enable")
    (tmp_path / "checkpoint" / "step-10").mkdir(parents=True)
    (tmp_path / "checkpoint" / "step-2").mkdir()
    install_on(FakeProcessor)
    install_on(FakeProcessor)  # idempotent
    proc = FakeProcessor(skipped=3, job_config=cfg)
    with caplog.at_level(logging.INFO):
        for step, loss in enumerate([4.0, 3.0, 2.0], start=1):
            proc.log(step, loss, loss, 1.0, {"n_tokens_seen": 100 * step, "lr": 1e-3})
        proc.close()
    assert proc.logged == [1, 2, 3] and proc.closed
    assert "3 matrix updates skipped so far on rank 0" in caplog.text
    text = caplog.text
    assert "Run summary: 3 logged steps (1-3)" in text
    assert "loss: final 2.0000, mean of the last 3 logged steps 3.0000" in text
    assert "tokens/s over all ranks" in text
    assert "peak memory (rank 0): 1.50 GiB" in text
    assert f"checkpoints: {tmp_path / 'checkpoint'} (step-2, step-10)" in text
    assert "Muon updates skipped (non-finite, rank 0): 3" in text


def test_torchtitans_metrics_processor_records_the_summary() -> None:
    from torchtitan.components.metrics import MetricsProcessor

    assert getattr(MetricsProcessor.log, "_muon_plugin_hook", False)
    assert getattr(MetricsProcessor.close, "_muon_plugin_hook", False)


def test_a_setting_newer_than_the_checkpoint_takes_the_jobs_value(tmp_path, caplog) -> None:
    model = tiny_model()
    opt, sched = build(model, "--optimizer.name", "muon")
    train(model, opt, sched, 2)
    dcp.save({"optimizer": opt}, checkpoint_id=str(tmp_path / "old"))
    again, _ = build(copy.deepcopy(model), "--optimizer.name", "muon")
    for g in again.optimizers[0].param_groups:
        g["future_setting"] = 3
    with caplog.at_level(logging.INFO):
        _dcp_load({"optimizer": again}, str(tmp_path / "old"))
    assert "has no future_setting setting (saved by a version before it existed)" in caplog.text
    assert all(g["future_setting"] == 3 for g in again.optimizers[0].param_groups)
    saved, loaded = opt.state_dict(), again.state_dict()
    key = next(k for k in saved if k.endswith("momentum_buffer"))
    assert torch.equal(saved[key], loaded[key])
