"""scripts/prepare_data.py with other torch / torchtitan releases than the pinned ones (a user's
own environment, ``PYTHON=$(which python) scripts/train.sh``): never a refusal.

The installed releases are faked (the script's version reader is replaced), so every case runs
in this process in about a second: building from other releases is one warning naming what
differs, and the manifest records them; a ``data/`` built by other releases is used as it is
with one line saying so (never rebuilt nor refused on a second run); only a pinned environment
rebuilds a corpus of other releases, so that its corpus stays the pinned one.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"
SMALL = ["--max-bytes", "200000", "--tokenizer-bytes", "50000", "--vocab-size", "300"]
PINNED = {"torch": "2.13.0", "torchtitan": "0.2.2"}
USER = {"torch": "2.11.0", "torchtitan": "0.2.2"}  # a cluster image's torch
FILES = ("corpus/data.json", "corpus_val/data.json", "tokenizer/tokenizer.json")


@functools.cache
def load_script():
    """scripts/prepare_data.py as a module (imported once)."""
    spec = importlib.util.spec_from_file_location("_muon_prepare_data_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def documents() -> list[tuple[str, str]]:
    """The installed sources, read once (the releases are faked, the files are these)."""
    return UNPATCHED_SOURCES()


UNPATCHED_SOURCES = load_script().source_documents


def run(monkeypatch, capsys, out: Path, versions: dict[str, str], *args: str) -> tuple[str, str]:
    """``prepare_data.py --out OUT`` (small sizes) with ``versions`` installed: (stdout,
    stderr); fails the test unless it exits 0."""
    script = load_script()
    monkeypatch.setattr(script, "installed_release", lambda name: versions[name])
    monkeypatch.setattr(script, "source_documents", documents)
    # Counting the held-out tokens (a second, single-threaded) is not what these tests check.
    monkeypatch.setattr(script, "count_tokens", lambda tok, texts: len(texts))
    assert script.main(["--out", str(out), *SMALL, *args]) == 0
    return capsys.readouterr()


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def stamps(out: Path) -> dict[str, int]:
    return {rel: (out / rel).stat().st_mtime_ns for rel in FILES}


def test_other_releases_build_with_one_warning_naming_what_differs(monkeypatch, capsys, tmp_path):
    stdout, stderr = run(monkeypatch, capsys, tmp_path / "data", USER)
    assert stderr.splitlines() == [
        "[prepare_data] warning: torch 2.11.0 (pinned: 2.13.0): the corpus is built from this "
        "environment's sources, so it and its sha256 differ from the pinned corpus"
    ]
    saved = manifest(tmp_path / "data")
    assert saved["key"]["packages"] == USER  # what it was built from, and its hashes
    assert f"corpus sha256 {saved['corpus_sha256'][:16]}" in stdout
    # torchtitan 0.3 on an older torch: compared with the torchtitan 0.3 corpus.
    titan03 = {"torch": "2.11.0", "torchtitan": "0.3.0"}
    _, stderr = run(monkeypatch, capsys, tmp_path / "b", titan03)
    assert stderr.startswith("[prepare_data] warning: torch 2.11.0 (pinned: 2.14.1): ")
    _, stderr = run(monkeypatch, capsys, tmp_path / "c", USER, "--any-version")
    assert stderr == ""


def test_a_corpus_built_by_other_releases_is_used_as_it_is(monkeypatch, capsys, tmp_path):
    """The pinned environment's data/, then the user's torch: used, one line; the user's own
    data/ on a second run: up to date (the failure this replaces: a refusal on that run)."""
    out = tmp_path / "data"
    run(monkeypatch, capsys, out, PINNED)
    before, sha = stamps(out), manifest(out)["corpus_sha256"]
    stdout, stderr = run(monkeypatch, capsys, out, USER)
    assert stdout.splitlines() == [
        f"[prepare_data] {out} is up to date: corpus sha256 {sha[:16]}, built from torch "
        "2.13.0, torchtitan 0.2.2, used as it is (this environment: torch 2.11.0, torchtitan "
        "0.2.2; --force rebuilds it)"
    ]
    assert stderr == "" and stamps(out) == before

    own = tmp_path / "own"
    run(monkeypatch, capsys, own, USER)
    before = stamps(own)
    stdout, stderr = run(monkeypatch, capsys, own, USER)
    assert "is up to date" in stdout and "(from torch 2.11.0, torchtitan 0.2.2)" in stdout
    assert stderr == "" and stamps(own) == before
    # Another unpinned release (the image was updated): still used as it is.
    stdout, _ = run(monkeypatch, capsys, own, {"torch": "2.12.0", "torchtitan": "0.2.2"})
    assert "built from torch 2.11.0, torchtitan 0.2.2, used as it is" in stdout
    assert stamps(own) == before


def test_a_pinned_environment_rebuilds_a_corpus_of_other_releases(monkeypatch, capsys, tmp_path):
    out = tmp_path / "data"
    run(monkeypatch, capsys, out, USER)
    stdout, stderr = run(monkeypatch, capsys, out, PINNED)
    assert stdout.splitlines()[0] == (
        f"[prepare_data] {out} was built from torch 2.11.0, torchtitan 0.2.2: rebuilding the "
        "pinned corpus of torch 2.13.0, torchtitan 0.2.2"
    )
    assert stderr == "" and manifest(out)["key"]["packages"] == PINNED
    # The other environment's pinned corpus is kept, as before.
    stdout, _ = run(monkeypatch, capsys, out, {"torch": "2.14.1", "torchtitan": "0.3.0"})
    assert "is up to date" in stdout and "(from torch 2.13.0, torchtitan 0.2.2)" in stdout


def test_the_mismatch_names_each_release_against_the_nearest_pinned_corpus():
    script = load_script()
    assert script.version_mismatch(PINNED) is None
    assert script.version_mismatch({"torch": "unknown", "torchtitan": "0.3.1"}) == (
        "torch unknown (pinned: 2.14.1), torchtitan 0.3.1 (pinned: 0.3.0)"
    )
    assert script.installed_release("no_such_package_of_muon_plugin") == "unknown"


@pytest.mark.parametrize("versions", [PINNED, USER])
def test_changed_options_rebuild(monkeypatch, capsys, tmp_path, versions):
    out = tmp_path / "data"
    run(monkeypatch, capsys, out, versions)
    run(monkeypatch, capsys, out, versions, "--seed", "1")
    assert manifest(out)["key"]["seed"] == 1
