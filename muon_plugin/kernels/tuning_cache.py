"""Autotuned kernel configs kept on disk, so that a new process skips the autotuning.

Autotuning the symmetric kernel times every candidate config for every new shape: seconds on
the first step of every process. The winners are stored in one JSON file per GPU model and
Triton version (``autotune-<gpu>-sm<capability>-<SMs>sms-triton<version>.json``), under a key of
the kernel's source hash (:func:`source_hash`) and the launch key (shape, dtypes, flags); a
changed kernel, another GPU or another Triton looks up other keys, so a stale entry is never
used.

Location: ``$MUON_PLUGIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/muon_plugin``, else
``~/.cache/muon_plugin``. Behind it, read only, the tables shipped with the package
(``muon_plugin/kernels/tuned/``, same file names): measured on the GPUs the project benchmarks
on, they spare even the first process on such a machine its autotuning, as long as the kernel
source and Triton version match. Behind those, the shipped tables of other GPUs of the same
family (compute capability and SM count, e.g. an H100 SXM and an H200: the same SMs, shared
memory and tensor cores, so the same tiles win): a config found there is valid on this GPU
and close to its best, and is used rather than autotuning on the first step.
``MUON_PLUGIN_AUTOTUNE_CACHE=0`` turns all of them off (then every process autotunes, as Triton
does by default); ``MUON_PLUGIN_AUTOTUNE_CACHE=own`` keeps only this machine's table (a GPU
tuned afresh, to ship its table). An unreadable or unwritable file is ignored: the kernel then
autotunes as if there were no file. The variables are read by :func:`read_tuning_settings`,
which every optimizer calls when it is built (so that no step reads the environment), and
otherwise at the first use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("muon_plugin.kernels")


@dataclass(frozen=True)
class TuningSettings:
    """The environment's say on the tables (see the module docstring), read at one time."""

    cache_dir: Path
    enabled: bool
    own_table_only: bool


_settings: TuningSettings | None = None


def read_tuning_settings() -> TuningSettings:
    """Read ``MUON_PLUGIN_CACHE_DIR``, ``XDG_CACHE_HOME`` and ``MUON_PLUGIN_AUTOTUNE_CACHE`` now;
    later lookups use what was read."""
    global _settings
    explicit = os.environ.get("MUON_PLUGIN_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME")
    mode = os.environ.get("MUON_PLUGIN_AUTOTUNE_CACHE", "1")
    _settings = TuningSettings(
        cache_dir=Path(explicit)
        if explicit
        else (Path(xdg) if xdg else Path.home() / ".cache") / "muon_plugin",
        enabled=mode != "0",
        own_table_only=mode == "own",
    )
    return _settings


def tuning_settings() -> TuningSettings:
    """The settings last read (read now if never)."""
    return _settings if _settings is not None else read_tuning_settings()


def cache_dir() -> Path:
    """Where the tables live (see the module docstring)."""
    return tuning_settings().cache_dir


PACKAGED_DIR = Path(__file__).parent / "tuned"
"""The tables shipped with the package (read only)."""


def source_hash(kernel: Any) -> str:
    """A hash of a Triton kernel's source and of the sources and constant globals it uses.

    Unlike Triton's own ``cache_key`` it does not depend on where the kernel sits in its file,
    so editing other code leaves the stored configs valid.
    """
    digest = hashlib.sha256()
    seen: set[int] = set()

    def visit(fn: Any) -> None:
        if id(fn) in seen:
            return
        seen.add(id(fn))
        digest.update(fn.src.encode())
        for name in sorted(fn.fn.__code__.co_names):
            value = fn.__globals__.get(name)
            if hasattr(value, "src") and hasattr(value, "fn"):  # a @triton.jit function it calls
                visit(value)
            elif isinstance(value, (int, float, bool, str)) or type(value).__name__ == "constexpr":
                digest.update(f"{name}={value!r}".encode())

    visit(kernel)
    return digest.hexdigest()[:16]


def enabled() -> bool:
    """False when ``MUON_PLUGIN_AUTOTUNE_CACHE=0``."""
    return tuning_settings().enabled


def own_table_only() -> bool:
    """True when ``MUON_PLUGIN_AUTOTUNE_CACHE=own``: this machine's table only, none shipped
    (to tune a GPU afresh, e.g. to ship its own table)."""
    return tuning_settings().own_table_only


class TuningCache:
    """The table of one GPU model and Triton version, read once and written on each new entry.

    ``family`` (``"sm90-132sms"``: compute capability and SM count) names the GPUs whose shipped
    tables back this one's (see the module docstring); None: none do.
    """

    def __init__(self, gpu: str, triton_version: str, family: str | None = None) -> None:
        suffix = _file_part(
            f"{family}-triton{triton_version}" if family else f"triton{triton_version}"
        )
        self.path = cache_dir() / f"autotune-{_file_part(gpu)}-{suffix}.json"
        self._family_tables = f"autotune-*-{suffix}.json" if family else None
        """The glob of the shipped tables of this GPU's family (None: no family given)."""
        self.packaged_path = PACKAGED_DIR / self.path.name
        self._entries: dict[str, dict[str, Any]] | None = None
        self._packaged: dict[str, dict[str, Any]] | None = None
        self._siblings: list[tuple[Path, dict[str, dict[str, Any]]]] | None = None
        self._siblings_used: set[Path] = set()

    @staticmethod
    def entry_key(kernel_hash: str, key: tuple) -> str:
        """The kernel's source hash and the launch key, as a string."""
        return f"{kernel_hash}|{key!r}"

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._entries is None:
            self._entries = read_table(self.path)
        return self._entries

    def get(self, kernel_hash: str, key: tuple) -> dict[str, Any] | None:
        """The stored config for this kernel and launch key (this machine's table first, then
        the packaged one, then the packaged tables of the same family), or None."""
        if not enabled():
            return None
        entry = self.entry_key(kernel_hash, key)
        found = self._load().get(entry)
        if found is not None or own_table_only():
            return found
        if self._packaged is None:
            self._packaged = read_table(self.packaged_path)
        found = self._packaged.get(entry)
        return self._from_siblings(entry) if found is None else found

    def _from_siblings(self, entry: str) -> dict[str, Any] | None:
        if self._siblings is None:
            pattern = self._family_tables
            paths = sorted(PACKAGED_DIR.glob(pattern)) if pattern else []
            self._siblings = [(p, read_table(p)) for p in paths if p != self.packaged_path]
        for path, entries in self._siblings:
            found = entries.get(entry)
            if found is not None:
                if path not in self._siblings_used:
                    self._siblings_used.add(path)
                    logger.info(
                        "autotuned kernel configs taken from %s (a GPU of the same family) for %s",
                        path.name,
                        self.path.name,
                    )
                return found
        return None

    def put(self, kernel_hash: str, key: tuple, config: dict[str, Any]) -> None:
        """Store a config (merged with what the file holds now, written atomically)."""
        if not enabled():
            return
        self._entries = None  # pick up what other processes wrote meanwhile
        entries = self._load()
        entries[self.entry_key(kernel_hash, key)] = config
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not write the autotune cache %s (%s)", self.path, e)


def _file_part(text: str) -> str:
    """``text`` with every run of characters other than letters, digits and dots as one dash."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def read_table(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of one table file; {} when it is missing or unreadable (with a warning)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring the autotune cache %s (%s)", path, e)
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}
