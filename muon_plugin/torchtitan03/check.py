"""Check a torchtitan 0.3 config and its command-line overrides in one process, in seconds.

    python -m muon_plugin.torchtitan03.check --module M --config F [torchtitan overrides ...]

``scripts/train.sh`` runs it before torchrun starts any worker. It parses exactly as
torchtitan 0.3's trainer does (``ConfigManager().parse_args``, then ``apply_overrides`` when
``--override.imports`` is given), so that a typo is ONE line naming the key as ``section.field``
with a did-you-mean instead of tyro's box under every rank's traceback::

    config error: optimizer.muon.ns_stepz: unknown key (command line --optimizer.muon.ns_stepz);
    did you mean optimizer.muon.ns_steps?

When the optimizer is Muon's (``MuonOptimizersContainer.Config``) it also checks the job-wide
optimizer values, the ``optimizer.muon_toml`` table (unknown keys with a did-you-mean, bad
values), the Muon options in force and the class rules. On success it prints the job's
``dump_folder`` on the first line of stdout, then each local path the job reads, one per line
(:func:`~muon_plugin.torchtitan.job_paths.read_paths`), and exits 0; on an error it exits 2.
``--help`` is left to torchtitan (exit 0, nothing printed).
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

from muon_plugin.param_groups.messages import (
    first_line,
    one_line,
    unknown_key,
    unrecognized_options,
)

__all__ = ["check", "check_muon", "main"]

_PREFIX = "optimizer.muon."


def check_muon(opt: Any) -> None:
    """Check a ``MuonOptimizersContainer.Config``: job-wide values, ``muon_toml``, the Muon
    options in force and the class rules; raises ``ValueError`` naming the key."""
    from muon_plugin.param_groups.options import MUON_CONFIG_KEYS, validate_optimizer_section
    from muon_plugin.param_groups.table import apply_table, read_muon_table

    validate_optimizer_section(opt)
    opt.muon.validate()  # the options and their class rules, before the table's values
    if opt.muon_toml:
        table = read_muon_table(opt.muon_toml)
        unknown = [key for key in table if key not in MUON_CONFIG_KEYS]
        if unknown:
            keys = [_PREFIX + k for k in MUON_CONFIG_KEYS]
            raise ValueError(unknown_key(_PREFIX + unknown[0], f"in {opt.muon_toml}", keys))
        try:  # what resolve_muon_config does, with the table already read
            apply_table(opt.muon, table).validate()
        except ValueError as e:  # the options alone were valid: the table's value is not
            raise ValueError(f"{first_line(e)} (in {opt.muon_toml})") from None


def check(args: list[str]) -> Any:
    """The parsed config (``--module``, ``--config``, overrides), overrides applied; raises
    ``ValueError`` with a one-line message naming the key."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    from muon_plugin.torchtitan03.container import MuonOptimizersContainer

    captured = io.StringIO()  # tyro's box, torchtitan's warnings: never shown on success
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            config = ConfigManager().parse_args(list(args))
            if config.override.imports:  # as the trainer does, before building anything
                apply_overrides(config.override, config)
            validate_cuda_graphs = getattr(config, "_validate_cuda_graphs", None)
            if validate_cuda_graphs is not None:  # what the trainer checks next
                validate_cuda_graphs()
            if isinstance(config.optimizer, MuonOptimizersContainer.Config):
                check_muon(config.optimizer)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        text = captured.getvalue()
        raise ValueError(unrecognized_options(text, args) or one_line(text)) from None
    except (ValueError, TypeError, ImportError) as e:
        raise ValueError(first_line(e)) from None
    return config


def main(argv: list[str] | None = None) -> int:
    """The command line: print the dump folder and the paths the job reads (0), or one
    ``config error:`` line (2)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print((__doc__ or "").strip())
        return 0
    if "--help" in argv or "-h" in argv:
        return 0  # torchtitan prints the help itself
    try:
        config = check(argv)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from muon_plugin.torchtitan.job_paths import read_paths

    print(config.dump_folder)
    for path in read_paths(config):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
