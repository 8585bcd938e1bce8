"""Check a torchtitan job config and its command-line overrides in one process, in seconds.

    python -m muon_plugin.torchtitan.check CONFIG [torchtitan overrides ...]

``scripts/train.sh`` runs it before torchrun starts any worker. It parses exactly as
``torchtitan.train`` does (torchtitan's ``ConfigManager``, with ``job.custom_config_module``), and
first looks for unknown keys itself, in the TOML and in the overrides, so that a typo is ONE
line naming the key as ``section.field`` with a did-you-mean::

    config error: optimizer.muon.ns_stepz: unknown key (in configs/x.toml); did you mean
    optimizer.muon.ns_steps?

Bad values (a choice not offered, ``optimizer.lr = -1``, ``optimizer.muon.ns_steps = 0``) are
one line too. On success it prints the job's ``dump_folder`` on the first line of stdout, then
each local path the job reads, one per line (:func:`~muon_plugin.torchtitan.job_paths.read_paths`:
absolute; ``scripts/train.sh`` builds the local corpus only when one lies in it), and exits 0;
on an error it exits 2. Users need it (``scripts/train.sh`` runs it); it parses with
``ConfigManager``'s own helpers (``_maybe_load_toml``, ``_maybe_add_custom_config``), private
in 0.2.2, because only they read a TOML and a custom config module exactly as the trainer does.
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import fields, is_dataclass
from typing import Any

from muon_plugin.param_groups.messages import (
    first_line,
    one_line,
    unknown_key,
    unrecognized_options,
)

__all__ = ["check", "main", "unknown_cli_key", "unknown_toml_key"]


def _fields(cls: Any) -> dict[str, Any]:
    return {f.name: f.type for f in fields(cls)}


def _leaf_keys(cls: Any, prefix: str = "") -> list[str]:
    out = []
    for name, typ in _fields(cls).items():
        if is_dataclass(typ):
            out.extend(_leaf_keys(typ, f"{prefix}{name}."))
        else:
            out.append(f"{prefix}{name}")
    return out


def unknown_toml_key(cls: Any, data: dict[str, Any], source: str, prefix: str = "") -> str | None:
    """The first key of ``data`` (a parsed TOML) that ``cls`` has no field for, as a message."""
    known = _fields(cls)
    for key, value in data.items():
        if key not in known:
            return unknown_key(f"{prefix}{key}", f"in {source}", [f"{prefix}{k}" for k in known])
        if is_dataclass(known[key]):
            if not isinstance(value, dict):
                return f"{prefix}{key}: expected a [{prefix}{key}] table (in {source})"
            found = unknown_toml_key(known[key], value, source, f"{prefix}{key}.")
            if found:
                return found
    return None


def unknown_cli_key(cls: Any, args: list[str]) -> str | None:
    """The first ``--section.field`` override ``cls`` has no field for, as a message."""
    leaves = _leaf_keys(cls)
    known = set(leaves)
    for arg in args:
        if not arg.startswith("--") or arg in ("--help", "-h"):
            continue
        key = arg[2:].split("=", 1)[0].replace("-", "_")
        head, _, last = key.rpartition(".")
        alternatives = {key}
        if last.startswith("no_"):  # tyro's --section.no-flag form of booleans
            alternatives.add(f"{head}.{last[3:]}" if head else last[3:])
        if not alternatives & known:
            return unknown_key(key, f"command line {arg}", leaves)
    return None


def check(config: str, args: list[str]) -> Any:
    """The parsed job config; raises ``ValueError`` with a one-line message naming the key."""
    from torchtitan.config import ConfigManager

    full = ["--job.config_file", config, *args]
    manager = ConfigManager()
    try:
        toml = manager._maybe_load_toml(full)
    except FileNotFoundError:
        raise ValueError(f"config file not found: {config}") from None
    except Exception as e:  # tomllib.TOMLDecodeError
        raise ValueError(f"{config}: not valid TOML: {e}") from None
    try:
        cls = manager._maybe_add_custom_config(full, toml)
    except ImportError as e:
        raise ValueError(f"job.custom_config_module: cannot import it: {e}") from None
    found = unknown_toml_key(cls, toml or {}, config) or unknown_cli_key(cls, args)
    if found:
        raise ValueError(found)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            job = manager.parse_args(full)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        text = captured.getvalue()
        raise ValueError(unrecognized_options(text, full) or one_line(text)) from None
    except (ValueError, TypeError) as e:
        raise ValueError(first_line(e)) from None

    from muon_plugin.torchtitan.register import is_muon

    if is_muon(job.optimizer.name):
        from muon_plugin.param_groups.options import validate_optimizer_section

        validate_optimizer_section(job.optimizer)
        muon = getattr(job.optimizer, "muon", None)
        if muon is not None:
            muon.validate()  # the options and the class rules they give
    return job


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    config, args = argv[0], argv[1:]
    if "--help" in args or "-h" in args:
        return 0  # torchtitan prints the help itself
    try:
        job = check(config, args)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from muon_plugin.torchtitan.job_paths import read_paths

    print(job.job.dump_folder)
    for path in read_paths(job):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
