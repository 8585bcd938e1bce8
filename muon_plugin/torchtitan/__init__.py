"""torchtitan plugin of muon_plugin: ``optimizer.name = "muon"`` for any torchtitan model.

Enable it in the job TOML with ``[job] custom_config_module = "muon_plugin.torchtitan"`` (or
``--job.custom_config_module muon_plugin.torchtitan``). torchtitan imports this module while
it parses the config, before the ``Trainer`` exists; importing it

- switches torchtitan to CPU + gloo when the machine has no accelerator
  (:mod:`muon_plugin.torchtitan.cpu`; nothing changes on GPUs),
- installs the optimizer hooks (:mod:`muon_plugin.torchtitan.register`), idempotently,
- provides ``JobConfig``, which adds the ``[optimizer.muon]`` section
  (:mod:`muon_plugin.torchtitan.config`).
"""

from muon_plugin.torchtitan import cpu as _cpu

_cpu.apply()

from muon_plugin.torchtitan.config import JobConfig, MuonConfig, Optimizer  # noqa: E402
from muon_plugin.torchtitan.register import install as _install  # noqa: E402

_install()

__all__ = ["JobConfig", "MuonConfig", "Optimizer"]
