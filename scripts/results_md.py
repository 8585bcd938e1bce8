"""Shared by the benchmark scripts: rewrite one marked section of RESULTS.md, keep the rest."""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path | str, section: str, start: str, end: str) -> None:
    """Put ``section`` (which begins with ``start`` and ends with ``end``) into ``path``.

    An existing ``start ... end`` block is replaced in place; otherwise the section is appended
    (a new file gets a ``# Results`` title).
    """
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    if start in old and end in old and old.index(start) < old.index(end):
        before = old[: old.index(start)]
        after = old[old.index(end) + len(end) :].lstrip("\n")
        new = before + section.rstrip("\n") + "\n" + ("\n" + after if after else "")
    elif old:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        new = "# Results\n\n" + section
    path.write_text(new)


def markers(name: str) -> tuple[str, str]:
    """The ``<!-- name:start -->`` / ``<!-- name:end -->`` pair around a script's section."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(path: Path | str, name: str, body: str) -> None:
    """Put ``body`` between the markers of ``name`` in ``path`` (see ``replace_section``)."""
    start, end = markers(name)
    replace_section(path, f"{start}\n{body.rstrip()}\n{end}\n", start, end)
