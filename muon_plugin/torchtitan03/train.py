"""``python -m muon_plugin.torchtitan03.train ARGS``: torchtitan 0.3's trainer after
:func:`muon_plugin.torchtitan03.activate` (the CPU mode without an accelerator, the end-of-run
summary).

Arguments are torchtitan's (``--module``, ``--config``, overrides); on a GPU machine
``python -m torchtitan.train ARGS`` works as well (without the summary).
"""

from __future__ import annotations


def main() -> None:
    """Activate the plugin, then run ``torchtitan.train.main``."""
    from muon_plugin.torchtitan03 import activate

    activate()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
