#!/usr/bin/env python
"""Summarize what a pip installation report (``pip install --dry-run --report FILE``) would fetch.

    python scripts/download_size.py REPORT.json
    -> torch 2.13.0 (CUDA build) and 31 more packages, 3.21 GB to download

Used by scripts/setup_env.sh to say, in one line, what installing torch from PyPI costs
before it starts. Sizes come from the local file (``file://``) or the server's
``Content-Length`` (an HTTP ``HEAD`` per package, in parallel); a size that cannot be learned
is reported as unknown instead of guessed. Standard library only: it runs before torch exists.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CUDA_PREFIXES = ("nvidia-", "cuda-")


def url_size(url: str, timeout_s: float = 10.0) -> int | None:
    """Bytes behind ``url`` (a local file or an HTTP(S) download), or None if unknown."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.parse.unquote(parsed.path))
        return path.stat().st_size if path.is_file() else None
    try:
        request = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            length = response.headers.get("Content-Length")
        return int(length) if length is not None else None
    except (OSError, ValueError):
        return None


def summarize(report: dict) -> str:
    """One line: the torch build, how many other packages, the total download size."""
    items = report.get("install", [])
    if not items:
        return "nothing to download"
    with ThreadPoolExecutor(max_workers=8) as pool:
        sizes = list(pool.map(lambda item: url_size(item["download_info"]["url"]), items))
    names = [item["metadata"]["name"].lower() for item in items]
    cuda = sum(name.startswith(CUDA_PREFIXES) for name in names)
    head = f"{len(items)} packages"
    for item, name in zip(items, names, strict=True):
        if name == "torch":
            version = item["metadata"]["version"]
            build = "CPU build" if "+cpu" in version else "CUDA build" if cuda else "build"
            head = f"torch {version} ({build}) and {len(items) - 1} more packages"
            break
    known = [s for s in sizes if s is not None]
    if not known:
        return f"{head}, download size unknown"
    total = f"{sum(known) / 1e9:.2f} GB"
    if len(known) < len(sizes):
        total = f"at least {total} ({len(sizes) - len(known)} sizes unknown)"
    extra = f", {cuda} of them NVIDIA/CUDA libraries" if cuda else ""
    return f"{head}{extra}, {total} to download"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: download_size.py REPORT.json", file=sys.stderr)
        return 2
    print(summarize(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
