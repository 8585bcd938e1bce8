#!/usr/bin/env python
"""Build a small local training corpus and a BPE tokenizer for the torchtitan demo configs.

Nothing is downloaded. The text comes from what every machine with this stack has installed:

- the Python reference documentation shipped with CPython (``pydoc_data.topics``),
- the docstrings of the Python standard library modules (parsed with :mod:`ast`, not
  imported),
- the license texts of CPython and of the installed packages (``*.dist-info/LICENSE*``).

Output (default ``data/``, change with ``--out``)::

    data/corpus/data.json          JSON lines {"text": ...}: torchtitan's "c4_test" loader
                                   (datasets.load_dataset(<folder>, split="train")) reads it via
                                   --training.dataset_path data/corpus
    data/tokenizer/tokenizer.json  byte-level BPE (tokenizers library), vocab --vocab-size
    data/tokenizer/tokenizer_config.json
                                   bos/eos tokens for torchtitan's HuggingFaceTokenizer; use
                                   --model.hf_assets_path data/tokenizer
    data/manifest.json             what was built from what; a second run with the same
                                   options and inputs does nothing (--force rebuilds)

The documents are deterministically shuffled (fixed seed) and the tokenizer is trained
single-threaded, so the same inputs give byte-identical outputs.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import shutil
import site
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

FORMAT_VERSION = 1
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
SKIP_STDLIB_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


def _clean(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return "\n".join(lines).strip()


def pydoc_topics() -> list[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [(f"pydoc:{k}", _clean(v)) for k, v in sorted(topics.items()) if v.strip()]


def _module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                title = "" if isinstance(node, ast.Module) else f"{node.name}\n"
                parts.append(title + doc.strip())
    return "\n\n".join(parts)


def stdlib_docstrings() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_STDLIB_DIRS for part in rel.parts[:-1]):
            continue
        text = _module_docstrings(path)
        if len(text) >= 200:
            docs.append((f"stdlib:{rel.as_posix()}", _clean(text)))
    return docs


def license_texts() -> list[tuple[str, str]]:
    candidates = [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"]
    roots = [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]]
    for root in roots:
        if root.is_dir():
            for dist in sorted(root.glob("*.dist-info")):
                for f in sorted(dist.rglob("*")):
                    if f.is_file() and f.name.upper().startswith(("LICENSE", "COPYING")):
                        candidates.append(f)
    docs, seen = [], set()
    for f in candidates:
        try:
            text = _clean(f.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        digest = hashlib.sha1(text.encode()).hexdigest()
        if len(text) >= 200 and digest not in seen:
            seen.add(digest)
            docs.append((f"license:{f.parent.name}/{f.name}", text))
    return docs


def collect(max_bytes: int, seed: int) -> list[tuple[str, str]]:
    docs = pydoc_topics() + stdlib_docstrings() + license_texts()
    random.Random(seed).shuffle(docs)
    out, total = [], 0
    for name, text in docs:
        if total >= max_bytes:
            break
        out.append((name, text))
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


def _manifest_key(args: argparse.Namespace) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "max_bytes": args.max_bytes,
        "vocab_size": args.vocab_size,
        "seed": args.seed,
    }


def _up_to_date(out: Path, key: dict) -> bool:
    manifest = out / "manifest.json"
    needed = [
        out / "corpus" / "data.json",
        out / "tokenizer" / "tokenizer.json",
        out / "tokenizer" / "tokenizer_config.json",
    ]
    if not manifest.is_file() or not all(p.is_file() for p in needed):
        return False
    try:
        return json.loads(manifest.read_text()).get("key") == key
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="output folder (default: data)")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=6_000_000,
        help="stop adding documents past this many bytes of text (default: 6 MB)",
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
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print("[prepare_data]", *a))

    out = Path(args.out)
    key = _manifest_key(args)
    if not args.force and _up_to_date(out, key):
        log(f"{out} is up to date (use --force to rebuild)")
        return 0

    t0 = time.time()
    docs = collect(args.max_bytes, args.seed)
    if not docs:
        print("[prepare_data] no text found on this machine", file=sys.stderr)
        return 1
    texts = [t for _, t in docs]
    n_bytes = sum(len(t.encode()) for t in texts)
    log(f"collected {len(docs)} documents, {n_bytes / 1e6:.1f} MB of text")

    tok = train_tokenizer(texts, args.vocab_size)
    log(f"trained BPE tokenizer: vocab {tok.get_vocab_size()}")

    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".prepare_data.", dir=out))
    try:
        (staging / "corpus").mkdir()
        with open(staging / "corpus" / "data.json", "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        (staging / "tokenizer").mkdir()
        tok.save(str(staging / "tokenizer" / "tokenizer.json"))
        (staging / "tokenizer" / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(1 << 20), indent=2) + "\n"
        )
        sample = tok.encode(texts[0][:2000]).ids
        manifest = {
            "key": key,
            "documents": len(docs),
            "bytes": n_bytes,
            "tokens_per_byte_sample": round(len(sample) / max(1, len(texts[0][:2000])), 3),
            "sources": sorted({name.split(":", 1)[0] for name, _ in docs}),
            "sha256": {
                rel: hashlib.sha256((staging / rel).read_bytes()).hexdigest()
                for rel in (
                    "corpus/data.json",
                    "tokenizer/tokenizer.json",
                    "tokenizer/tokenizer_config.json",
                )
            },
        }
        for sub in ("corpus", "tokenizer"):
            if (out / sub).exists():
                shutil.rmtree(out / sub)
            os.replace(staging / sub, out / sub)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"wrote {out}/corpus/data.json and {out}/tokenizer/ in {time.time() - t0:.1f}s "
        f"(--training.dataset_path {out}/corpus --model.hf_assets_path {out}/tokenizer)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
