"""torchtitan 0.3 plugin of muon_plugin: Muon as the optimizer of any torchtitan 0.3 config.

- :class:`~muon_plugin.torchtitan03.container.MuonOptimizersContainer` and its ``Config`` (every
  Muon option a typed, documented field ``optimizer.muon.<option>``), for Python configs;
- :func:`~muon_plugin.torchtitan03.override.muon`, for ``--override.imports
  muon_plugin.torchtitan03.override.muon``: swaps the optimizer of any shipped config for Muon;
- :mod:`muon_plugin.torchtitan03.configs`: ready configs (``--module
  muon_plugin.torchtitan03.configs --config llama3_debugmodel``, or any shipped config as
  ``--config <model>.<config function>``) whose Muon options are CLI flags;
- :func:`activate`: the CPU mode (only without an accelerator), a torch-version shim and the
  end-of-run summary, applied by ``python -m muon_plugin.torchtitan03.train`` (torchtitan's
  ``torchtitan.train`` after :func:`activate`). Importing this package changes nothing in
  torchtitan;
- :mod:`muon_plugin.torchtitan03.check`: the one-process config check ``scripts/train.sh`` runs
  before torchrun (a typo or a bad value is one line naming the key).
"""

from __future__ import annotations

__all__ = ["activate"]


def activate() -> bool:
    """Prepare torchtitan 0.3 for this machine (idempotent); True when the CPU mode is on.

    Without an accelerator: CPU devices, gloo, FSDP SUM reductions, eager FlexAttention
    (:mod:`muon_plugin.torchtitan03.cpu_mode`). With any device: on a torch without
    ``torch.distributed.set_timeout`` (before 2.14) torchtitan's post-first-step timeout change
    is skipped with a warning instead of failing (:mod:`muon_plugin.torchtitan03.compat`).
    Always: rank 0 logs the end-of-run summary (loss, throughput, peak memory, checkpoints;
    :mod:`muon_plugin.torchtitan03.summary`), and a checkpoint holding another optimizer's
    state is refused by name (:mod:`muon_plugin.torchtitan.checkpoint`).
    """
    from muon_plugin.torchtitan import checkpoint
    from muon_plugin.torchtitan03 import compat, cpu_mode, summary

    compat.apply()
    summary.install()
    checkpoint.install()
    return cpu_mode.apply()
