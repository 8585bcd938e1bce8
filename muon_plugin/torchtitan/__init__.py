"""torchtitan 0.2.2 plugin of muon_plugin: ``optimizer.name = "muon"`` for any torchtitan model.

Enable it in the job TOML with ``[job] custom_config_module = "muon_plugin.torchtitan"`` (or
``--job.custom_config_module muon_plugin.torchtitan``). Importing this package changes nothing
in torchtitan. :func:`activate` does, idempotently:

- switches torchtitan to CPU + gloo when the machine has no accelerator
  (:mod:`muon_plugin.torchtitan.cpu_mode`; nothing changes on GPUs),
- installs the optimizer hooks (:mod:`muon_plugin.torchtitan.register`).

torchtitan 0.2.2 reads ``JobConfig`` (which adds the ``[optimizer.muon]`` section,
:mod:`muon_plugin.torchtitan.config`) from the module named by ``job.custom_config_module``
while it parses the config, before the ``Trainer`` exists: that lookup is the activation, so
naming the module in a config is all a job needs.
"""

from typing import Any

__all__ = ["JobConfig", "MuonConfig", "Optimizer", "activate"]

_CONFIG_NAMES = ("JobConfig", "MuonConfig", "Optimizer")


def activate() -> None:
    """Apply the CPU mode (only without an accelerator) and install the optimizer hooks."""
    from muon_plugin.torchtitan import cpu_mode, register

    cpu_mode.apply()
    register.install()


def __getattr__(name: str) -> Any:
    # torchtitan 0.2.2's ConfigManager does import_module(custom_config_module).JobConfig.
    if name in _CONFIG_NAMES:
        activate()
        from muon_plugin.torchtitan import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
