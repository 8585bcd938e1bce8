"""Write a randomly initialized model as the starting checkpoint of a torchtune config.

torchtune's recipes fine-tune: they load ``checkpointer.checkpoint_dir`` /
``checkpointer.checkpoint_files``. To train a model from scratch without the hub (the tiny
debug config, tests), this builds the config's ``model:`` with ``seed`` and saves its state dict
there, in the format of ``torchtune.training.FullModelTorchTuneCheckpointer``::

    python -m muon_plugin.torchtune.init_checkpoint --config configs/torchtune_llama3_2_muon.yaml

Overrides use torchtune's ``key=value`` syntax (``checkpointer.checkpoint_dir=/tmp/init``).
An existing file is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, training

__all__ = ["init_checkpoint", "main"]


def init_checkpoint(cfg: DictConfig, *, force: bool = False) -> tuple[Path, bool]:
    """Save ``cfg.model`` initialized with ``cfg.seed`` to the checkpointer's first file.

    Returns the path and whether it was written (False: it existed and ``force`` is off).
    """
    ckpt = cfg.checkpointer
    files = list(ckpt.checkpoint_files)
    if len(files) != 1:
        raise ValueError(f"checkpointer.checkpoint_files: expected one file, got {files}")
    path = Path(ckpt.checkpoint_dir) / files[0]
    if path.exists() and not force:
        return path, False
    training.set_seed(seed=cfg.get("seed", 0))
    with training.set_default_dtype(training.get_dtype(cfg.get("dtype", "fp32"))):
        model = config.instantiate(cfg.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path, True


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--config PATH [key=value ...] [--force]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="torchtune YAML config")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for tune run")
    args = parser.parse_args(argv)
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.overrides))
    path, written = init_checkpoint(cfg, force=args.force)
    print(f"[init_checkpoint] {'wrote' if written else 'kept existing'} {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
