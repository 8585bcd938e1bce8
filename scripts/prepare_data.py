#!/usr/bin/env python
"""Build the local training corpus and a BPE tokenizer for the torchtitan demo configs.

Nothing is downloaded, and the result is the same on every machine with the same pinned
packages: the text is the Python source (code, comments and docstrings) of the environment's
pinned packages, found with :mod:`importlib` and read as bytes in sorted path order, so it does
not depend on the user, ``HOME``, user-site paths, the locale or which Python's standard library
is installed. Files that differ between builds of the same release (``torch/version.py`` names
the CUDA version) are left out. One file is one document. Each environment of the project has
its corpus (``CORPORA``): torch 2.13.0 + torchtitan 0.2.2 (``./.venv``) and torch 2.14.1 +
torchtitan 0.3.0 (``./.venv-titan03``); an up-to-date ``OUT`` built by either is kept, so the
two environments share one ``data/`` (the manifest and the log say which corpus it is).

Output (default ``data/``, change with ``--out``)::

    data/corpus/data.json          JSON lines {"text": ...}, the training split: torchtitan's
                                   "c4_test" loader (datasets.load_dataset(<folder>,
                                   split="train")) reads it via --training.dataset_path
    data/corpus_val/data.json      the held-out split (every document whose path hashes into
                                   it, about 2%): --validation.dataset c4_test
                                   --validation.dataset_path data/corpus_val
    data/tokenizer/tokenizer.json  byte-level BPE (tokenizers library), vocab --vocab-size,
                                   trained on the first --tokenizer-bytes of the training
                                   split
    data/tokenizer/tokenizer_config.json
                                   bos/eos tokens for torchtitan's HuggingFaceTokenizer; use
                                   --model.hf_assets_path data/tokenizer
    data/manifest.json             package versions, sizes, token counts and the sha256 of
                                   every file; a second run with the same options and packages
                                   does nothing (--force rebuilds)

The documents are shuffled with a fixed seed and the tokenizer is trained single-threaded, so
the same inputs give byte-identical outputs; the log and the manifest give the corpus hash.

Other releases (your own environment, e.g. ``PYTHON=$(which python) scripts/train.sh``) are
never refused: the corpus is built from their sources with one warning naming the releases that
differ from the pinned ones (that corpus, and its sha256, differ from the pinned one), and a
``data/`` built by any releases is used as it is, with one line naming them. Only a pinned
environment rebuilds a ``data/`` built by other releases, so that its corpus stays the pinned one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

FORMAT_VERSION = 2
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
# The corpora: the packages whose sources make one, and their releases (one per environment).
CORPORA = (
    {"torch": "2.13.0", "torchtitan": "0.2.2"},  # ./.venv (torchtitan 0.2.2)
    {"torch": "2.14.1", "torchtitan": "0.3.0"},  # ./.venv-titan03 (torchtitan 0.3)
)
PACKAGES = tuple(CORPORA[0])
# Files that differ between builds of one release (CPU vs CUDA wheels).
BUILD_SPECIFIC = {"torch/version.py"}
SKIP_DIRS = {"__pycache__"}
VALIDATION_EVERY = 50  # a document is held out when sha256(path) % VALIDATION_EVERY == 0
MIN_DOC_BYTES = 200
OUTPUTS = (
    "corpus/data.json",
    "corpus_val/data.json",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
)


def release(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: builds of one release share their Python sources."""
    return version.split("+", 1)[0]


def package_dir(name: str) -> Path:
    """Where ``name`` is installed, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"[prepare_data] package {name!r} is not installed (scripts/setup_env.sh)")
    return Path(next(iter(spec.submodule_search_locations)))


def installed_release(name: str) -> str:
    """The installed release of ``name`` from its package metadata (``"unknown"`` when it has
    none, e.g. a source checkout on ``PYTHONPATH``)."""
    try:
        return release(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def package_versions() -> dict[str, str]:
    """The installed release of each corpus package."""
    return {name: installed_release(name) for name in PACKAGES}


def describe(versions: dict[str, str]) -> str:
    """``torch 2.13.0, torchtitan 0.2.2``."""
    return ", ".join(f"{n} {v}" for n, v in versions.items())


def version_mismatch(versions: dict[str, str]) -> str | None:
    """None for pinned releases (one of ``CORPORA``); else what differs from the nearest pinned
    corpus (the one sharing the most releases, then the most major.minor series), e.g.
    ``torch 2.11.0 (pinned: 2.13.0)``."""
    if versions in CORPORA:
        return None

    def series(v: str | None) -> list[str]:
        return (v or "").split(".")[:2]

    nearest = max(
        CORPORA,
        key=lambda c: (
            sum(versions.get(n) == v for n, v in c.items()),
            sum(series(versions.get(n)) == series(v) for n, v in c.items()),
        ),
    )
    return ", ".join(
        f"{n} {versions.get(n)} (pinned: {v})" for n, v in nearest.items() if versions.get(n) != v
    )


def source_documents() -> list[tuple[str, str]]:
    """``(relative path, text)`` of each distinct source file of PACKAGES, sorted by path."""
    docs = []
    for name in sorted(PACKAGES):
        base = package_dir(name).parent
        paths = []
        for dirpath, dirnames, filenames in os.walk(base / name):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
        for path in paths:
            rel = path.relative_to(base).as_posix()
            if rel in BUILD_SPECIFIC:
                continue
            text = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
            text = text.strip()
            if len(text) >= MIN_DOC_BYTES:
                docs.append((rel, text))
    docs.sort(key=lambda d: d[0].encode())
    seen: set[str] = set()
    unique = []  # a file copied under another path is one document (the first path)
    for rel, text in docs:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            unique.append((rel, text))
    return unique


def is_validation(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % VALIDATION_EVERY == 0


def split(docs: list[tuple[str, str]], max_bytes: int, seed: int) -> tuple[list[str], list[str]]:
    """Held-out and training texts; the training ones shuffled and cut at ``max_bytes``."""
    val = [t for rel, t in docs if is_validation(rel)]
    train = [(rel, t) for rel, t in docs if not is_validation(rel)]
    random.Random(seed).shuffle(train)
    out, total = [], 0
    for _, text in train:
        if total >= max_bytes:
            break
        out.append(text)
        total += len(text.encode())
    return out, val


def prefix(texts: list[str], n_bytes: int) -> list[str]:
    out, total = [], 0
    for text in texts:
        if total >= n_bytes:
            break
        out.append(text)
        total += len(text.encode())
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    os.environ["RAYON_NUM_THREADS"] = "1"  # deterministic merges
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def count_tokens(tok, texts: list[str]) -> int:
    return sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_len,
    }


def corpus_hash(sha256: dict[str, str]) -> str:
    """One hash of all outputs: sha256 over the sorted ``path sha256`` lines."""
    lines = "".join(f"{rel} {digest}\n" for rel, digest in sorted(sha256.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _manifest_key(args: argparse.Namespace, versions: dict[str, str]) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "packages": versions,
        "max_bytes": args.max_bytes,
        "tokenizer_bytes": args.tokenizer_bytes,
        "vocab_size": args.vocab_size,
        "seed": args.seed,
    }


def _built(out: Path, key: dict) -> dict | None:
    """The manifest when ``out`` holds every output, built with the options of ``key`` (from
    whatever package releases), else None."""
    manifest = out / "manifest.json"
    if not manifest.is_file() or not all((out / rel).is_file() for rel in OUTPUTS):
        return None
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    saved = data.get("key")
    if not isinstance(saved, dict) or not isinstance(saved.get("packages"), dict):
        return None
    if {**saved, "packages": key["packages"]} != key or "corpus_sha256" not in data:
        return None
    return data


def reusable(done: dict, versions: dict[str, str]) -> bool:
    """Whether a corpus built with the same options (manifest ``done``) serves an environment
    with ``versions``: always for unpinned releases (one line says whose corpus it is); for
    pinned ones when it is a pinned corpus, so that their corpus stays the pinned one."""
    built_from = done["key"]["packages"]
    return built_from == versions or built_from in CORPORA or versions not in CORPORA


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="output folder (default: data)")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=30_000_000,
        help="training split: stop adding documents past this many bytes (default: 30 MB, "
        "about 10 M tokens of the default tokenizer)",
    )
    parser.add_argument(
        "--tokenizer-bytes",
        type=int,
        default=2_000_000,
        help="train the tokenizer on the first this many bytes of the training split "
        "(default: 2 MB)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=2048,
        help="BPE vocabulary size incl. special tokens; must not exceed the model's "
        "vocab_size (2048 for the torchtitan debug models)",
    )
    parser.add_argument("--seed", type=int, default=0, help="document shuffle seed")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--any-version",
        action="store_true",
        help="build from other torch/torchtitan releases than the pinned ones without the "
        "warning (the corpus differs from the pinned one)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the result line")
    args = parser.parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print("[prepare_data]", *a))

    out = Path(args.out)
    versions = package_versions()
    key = _manifest_key(args, versions)
    done = None if args.force else _built(out, key)
    if done is not None and reusable(done, versions):
        built_from = done["key"]["packages"]
        line = f"[prepare_data] {out} is up to date: corpus sha256 {done['corpus_sha256'][:16]}"
        if built_from == versions or versions in CORPORA:  # this or the other pinned corpus
            print(f"{line} (from {describe(built_from)})")
        else:  # an environment of the user's own, with a corpus of other releases
            print(
                f"{line}, built from {describe(built_from)}, used as it is (this environment: "
                f"{describe(versions)}; --force rebuilds it)"
            )
        return 0
    if done is not None:
        print(
            f"[prepare_data] {out} was built from {describe(done['key']['packages'])}: "
            f"rebuilding the pinned corpus of {describe(versions)}"
        )
    mismatch = version_mismatch(versions)
    if mismatch and not args.any_version:
        print(
            f"[prepare_data] warning: {mismatch}: the corpus is built from this environment's "
            "sources, so it and its sha256 differ from the pinned corpus",
            file=sys.stderr,
        )

    t0 = time.time()
    docs = source_documents()
    train, val = split(docs, args.max_bytes, args.seed)
    n_bytes = sum(len(t.encode()) for t in train)
    log(
        f"collected {len(docs)} source files of {describe(versions)}: {len(train)} training "
        f"documents ({n_bytes / 1e6:.1f} MB), {len(val)} held out"
    )

    tok = train_tokenizer(prefix(train, args.tokenizer_bytes), args.vocab_size)
    log(f"trained BPE tokenizer: vocab {tok.get_vocab_size()}")
    # Encoding all of the training split single-threaded takes ~40 s: count the held-out
    # split exactly and estimate the training split at the same tokens per byte.
    val_bytes = sum(len(t.encode()) for t in val)
    val_tokens = count_tokens(tok, val)
    tokens = {
        "validation": val_tokens,
        "train_estimated": round(n_bytes * val_tokens / max(1, val_bytes)),
    }
    log(
        f"tokens: about {tokens['train_estimated'] / 1e6:.1f} M training (estimated), "
        f"{val_tokens / 1e6:.2f} M held out"
    )

    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".prepare_data.", dir=out))
    try:
        write_jsonl(staging / "corpus" / "data.json", train)
        write_jsonl(staging / "corpus_val" / "data.json", val)
        (staging / "tokenizer").mkdir()
        tok.save(str(staging / "tokenizer" / "tokenizer.json"))
        (staging / "tokenizer" / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(1 << 20), indent=2) + "\n"
        )
        sha256 = {rel: hashlib.sha256((staging / rel).read_bytes()).hexdigest() for rel in OUTPUTS}
        manifest = {
            "key": key,
            "sources": sorted(PACKAGES),
            "documents": {"train": len(train), "validation": len(val)},
            "bytes": {"train": n_bytes, "validation": val_bytes},
            "tokens": tokens,
            "corpus_sha256": corpus_hash(sha256),
            "sha256": sha256,
        }
        for sub in ("corpus", "corpus_val", "tokenizer"):
            if (out / sub).exists():
                shutil.rmtree(out / sub)
            os.replace(staging / sub, out / sub)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"wrote {out}/corpus, {out}/corpus_val and {out}/tokenizer in {time.time() - t0:.1f}s "
        f"(--training.dataset_path {out}/corpus --model.hf_assets_path {out}/tokenizer)"
    )
    print(f"[prepare_data] {out}: corpus sha256 {manifest['corpus_sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
