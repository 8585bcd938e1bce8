"""The README's QK-Clip section, read by the tests that run what it shows."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def section() -> str:
    """The text of ``## QK-Clip (MuonClip)`` up to the next ``## `` heading."""
    text = README.read_text()
    start = text.index("## QK-Clip (MuonClip)")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def blocks(language: str) -> list[str]:
    """The section's fenced code blocks of ``language``."""
    return re.findall(rf"```{language}\n(.*?)```", section(), flags=re.S)
