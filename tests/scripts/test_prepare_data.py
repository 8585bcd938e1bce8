"""scripts/prepare_data.py: a corpus that is the same wherever the pinned packages are installed.

The corpus is built from the sources of torch and torchtitan; it must not depend on the user
(HOME, user-site packages), the locale or the Python standard library, must be large enough for
a few hundred steps of a ~100M model (>= 8M tokens), hold out a validation split that
torchtitan's "c4_test" loader reads, and a second build must do nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"
FILES = (
    "corpus/data.json",
    "corpus_val/data.json",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
)


def build(out: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=out.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def texts(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("prepare") / "data"
    return out, build(out)


def test_manifest_hashes_the_files_and_the_log_names_the_hash(built):
    out, log = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["key"]["packages"] == {"torch": "2.13.0", "torchtitan": "0.2.2"}
    for rel in FILES:
        assert manifest["sha256"][rel] == hashlib.sha256((out / rel).read_bytes()).hexdigest()
    lines = "".join(f"{rel} {manifest['sha256'][rel]}\n" for rel in sorted(FILES))
    assert manifest["corpus_sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert f"corpus sha256 {manifest['corpus_sha256'][:16]}" in log


def test_large_enough_with_a_disjoint_validation_split(built):
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokens"]["train_estimated"] >= 8_000_000, manifest["tokens"]
    train, val = texts(out / "corpus" / "data.json"), texts(out / "corpus_val" / "data.json")
    assert (len(train), len(val)) == (
        manifest["documents"]["train"],
        manifest["documents"]["validation"],
    )
    assert len(val) >= 20 and not set(train) & set(val)
    # The held-out split is counted exactly, and the estimate uses its tokens per byte.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    assert tok.get_vocab_size() == 2048
    counted = sum(len(tok.encode(t, add_special_tokens=False).ids) for t in val)
    assert counted == manifest["tokens"]["validation"]


def test_second_build_is_a_no_op(built):
    out, _ = built
    stamps = {rel: (out / rel).stat().st_mtime_ns for rel in FILES}
    log = build(out)
    assert "is up to date" in log, log
    assert {rel: (out / rel).stat().st_mtime_ns for rel in FILES} == stamps


def test_same_corpus_for_another_user_locale_and_user_site(built, tmp_path):
    """Another HOME, the C locale and a user site with extra packages change nothing."""
    out, _ = built
    user_base = tmp_path / "userbase"
    site = user_base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    dist = site / "site-packages" / "extra_pkg-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "LICENSE").write_text("A license only this user has installed.\n" * 20)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: extra_pkg\nVersion: 1.0\n")
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), PYTHONUSERBASE=str(user_base), LC_ALL="C", LANG="C")
    other = tmp_path / "data"
    build(other, env)
    for rel in FILES:
        assert (other / rel).read_bytes() == (out / rel).read_bytes(), rel


def test_validation_split_reads_with_torchtitans_loader(built):
    """torchtitan's "c4_test" loader (what --validation.dataset c4_test uses) reads the split."""
    datasets = pytest.importorskip("datasets")
    out, _ = built
    ds = datasets.load_dataset(
        str(out / "corpus_val"), split="train", cache_dir=str(out.parent / "hf_cache")
    )
    assert ds[0]["text"] == texts(out / "corpus_val" / "data.json")[0]
