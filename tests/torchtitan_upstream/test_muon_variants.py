"""torchtitan 0.2.2's optimizer-building unit tests again, with ``optimizer.name = "muon"``.

- ``test_lr_scheduler.py``: every schedule test, with the optimizer the plugin builds
  (``MuonOptimizersContainer022``, Muon on the weight matrix, AdamW on the bias) instead of Adam.
- ``test_train_spec.py``: ``test_optim_hook`` with a train spec whose builder is the plugin's,
  for "muon" (the hook runs after a Muon step) and for a ``None`` config (torchtitan's test
  passes ``None`` to its custom builder).
- ``test_checkpoint.py`` builds no optimizer (a fake container and a mocked ``dcp``): it runs
  unchanged, with the plugin's checkpoint hook installed; no "muon" variant applies.
- torchtitan 0.2.2 has no unit test of the optimizer container itself; the plugin's container
  is tested in ``tests/torchtitan/test_torchtitan_builder.py`` and
  ``tests/torchtitan/test_torchtitan_resume.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch
import torch.nn as nn
from test_lr_scheduler import TestLRScheduler
from test_train_spec import FakeModel, fake_build_optimizers_with_hook
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import ConfigManager
from torchtitan.protocols import BaseModelArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from muon_plugin.torchtitan import register
from muon_plugin.torchtitan.builder import MuonOptimizersContainer022

PARALLEL_DIMS = SimpleNamespace(ep_enabled=False, pp_enabled=False)


def muon_config(lr: float = 0.1):
    return (
        ConfigManager()
        .parse_args(
            [
                "--job.custom_config_module",
                "muon_plugin.torchtitan",
                "--optimizer.name",
                "muon",
                "--optimizer.lr",
                str(lr),
            ]
        )
        .optimizer
    )


class TestLRSchedulerMuon(TestLRScheduler):
    """torchtitan's LR scheduler tests on the optimizer ``optimizer.name = "muon"`` builds."""

    def setUp(self):
        self.model = torch.nn.Linear(10, 10)
        container = register.build_optimizers([self.model], muon_config(0.1), PARALLEL_DIMS)
        assert isinstance(container, MuonOptimizersContainer022)
        self.optimizer = container.optimizers[0]
        assert [g["algorithm"] for g in self.optimizer.param_groups] == ["muon", "adamw"]
        self.optimizer._opt_called = True
        self.optimizer_container = MagicMock(spec=OptimizersContainer)
        self.optimizer_container.__iter__.return_value = iter([self.optimizer])
        self.optimizer_container.__len__.return_value = 1


@pytest.mark.parametrize("config", ["muon", None])
def test_optim_hook_with_the_plugins_builder(config) -> None:
    name = f"fake_muon_{config}"
    spec = TrainSpec(
        model_cls=FakeModel,
        model_args={"fake": BaseModelArgs()},
        parallelize_fn=None,
        pipelining_fn=None,
        build_optimizers_fn=fake_build_optimizers_with_hook,
        build_lr_schedulers_fn=None,
        build_dataloader_fn=None,
        build_tokenizer_fn=None,
        build_loss_fn=None,
    )
    register_train_spec(name, spec)
    new_spec = get_train_spec(name)
    model = new_spec.model_cls(BaseModelArgs())
    called = []

    def hook(optimizer, args, kwargs, model_parts: list[nn.Module]) -> None:
        called.append(type(optimizer).__name__)

    optimizers = new_spec.build_optimizers_fn(
        [model], None if config is None else muon_config(), PARALLEL_DIMS, None, hook
    )
    expected = "Adam" if config is None else "MuonForeach"
    assert type(optimizers.optimizers[0]).__name__ == expected
    model(torch.randn(8, 8)).sum().backward()
    if config is not None:
        optimizers.register_step_post_hook(lambda *a, **k: hook(optimizers, a, k, [model]))
    optimizers.step()
    assert called
