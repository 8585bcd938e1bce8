"""The heartbeat plugin (tests/support/heartbeat.py) prints a line while a long test runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def test_a_long_test_gets_a_line_every_period(tmp_path: Path) -> None:
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(3.5)\n\ndef test_quick():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "MUON_TEST_HEARTBEAT_S": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "heartbeat", "-p", "no:cacheprovider",
         str(tmp_path / "test_slow.py")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    beats = [line for line in proc.stdout.splitlines() if line.startswith("[tests] still running")]
    assert len(beats) >= 2 and all("test_slow.py::test_slow" in b for b in beats), proc.stdout
