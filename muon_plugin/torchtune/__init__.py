"""TorchTune integration of muon_plugin (torchtune 0.6.1, its own environment ``.venv-torchtune``).

- :func:`muon` (``optimizer: _component_: muon_plugin.torchtune.muon``): one Muon optimizer
  with the parameter classes, per-class settings and option schema of the torchtitan plugins
  (:mod:`muon_plugin.param_groups`), read from the YAML ``optimizer:`` section
  (:mod:`muon_plugin.torchtune.options`).
- :mod:`muon_plugin.torchtune.full_finetune`: torchtune's full-finetune recipe passing named
  parameters to the optimizer (``tune run muon_plugin/torchtune/full_finetune.py --config ...``).
- :func:`text_tokenizer`: a local ``tokenizer.json`` as a text-completion tokenizer.
- :mod:`muon_plugin.torchtune.init_checkpoint`: a random starting checkpoint for a config.
"""

from muon_plugin.torchtune.component import muon
from muon_plugin.torchtune.options import TorchtuneConfigError
from muon_plugin.torchtune.tokenizer import text_tokenizer

__all__ = ["TorchtuneConfigError", "muon", "text_tokenizer"]
