"""Corpora whose documents map one-to-one onto training samples, for the checkpoint tests of
torchtitan 0.2.2 and 0.3 (a resumed run must read exactly the samples the uninterrupted one read
after the split)."""

from __future__ import annotations

import json
from pathlib import Path


def exact_chunks(assets: Path, n: int, tokens: int = 255) -> list[str]:
    """Texts that tokenize to exactly ``tokens`` ids: with BOS/EOS each is one 257-token
    sample of seq_len 256, so a document list maps one-to-one onto training samples."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(assets / "tokenizer" / "tokenizer.json"))
    ids: list[int] = []
    with open(assets / "corpus" / "data.json", encoding="utf-8") as f:
        for line in f:
            ids.extend(tok.encode(json.loads(line)["text"]).ids)
            if len(ids) > 3 * n * tokens:
                break
    chunks = []
    for i in range(0, len(ids) - tokens, tokens):
        text = tok.decode(ids[i : i + tokens])
        if len(tok.encode(text).ids) == tokens:
            chunks.append(text)
            if len(chunks) == n:
                return chunks
    raise AssertionError("not enough text for the checkpoint test corpus")


def write_corpus(folder: Path, texts: list[str]) -> Path:
    """``folder/data.json``: one JSON line ``{"text": ...}`` per text (torchtitan's local
    loader); returns ``folder``."""
    folder.mkdir(parents=True)
    with open(folder / "data.json", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return folder
