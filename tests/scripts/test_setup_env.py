"""scripts/setup_env.sh without an NVIDIA GPU: which torch it installs, and what it says.

The venv's python is a stub that records its command lines (nothing is installed): with PyTorch's
CPU index answering, torch is the CPU build from that index; with the index unreachable, torch
comes from PyPI after one line giving the download. Every step is named on stdout.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup_env.sh"

STUB = """#!/usr/bin/env bash
echo "$*" >>"$STUB_LOG"
case "$1" in
    -c)  # torch exists once a pip install of it was recorded (then: the release it named)
        [[ "$2" == import* && "$2" != *print* ]] && exit 0  # the bytecode of what runs import
        pin="$(grep -v -- --dry-run "$STUB_LOG" | grep -o 'torch==[0-9.]*' | tail -1 | cut -d= -f3)"
        [[ -n "$pin" && "$2" == *print* ]] && { echo "$pin+cpu"; exit 0; }; exit 1 ;;
    -m)
        if [[ "$*" == *--dry-run* ]]; then
            while [[ $# -gt 0 && "$1" != --report ]]; do shift; done
            echo '{"install": [{"metadata": {"name": "torch", "version": "2.13.0"},
                   "download_info": {"url": "file:///nonexistent/torch.whl"}}]}' >"$2"
        fi
        exit 0 ;;
    *) exec "$REAL_PYTHON" "$@" ;;
esac
"""

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bash set-up script")


def fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(STUB)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return venv


def run_setup(tmp_path: Path, index: str, *args: str) -> tuple[str, list[str]]:
    venv = fake_venv(tmp_path)
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"  # PATH without nvidia-smi: a CPU-only machine
    bin_dir.mkdir()
    for tool in ("bash", "cat", "cut", "sha256sum", "mktemp", "rm", "dirname", "grep", "tail"):
        found = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        os.symlink(found, bin_dir / tool)
    env = dict(
        os.environ,
        PATH=str(bin_dir),
        MUON_PLUGIN_VENV=str(venv),
        MUON_PLUGIN_VENV_TITAN03=str(venv),
        MUON_PLUGIN_VENV_TORCHTUNE=str(venv),
        MUON_PLUGIN_TORCH_INDEX=index,
        MUON_PLUGIN_INDEX_TIMEOUT="3",
        BASE_PYTHON=sys.executable,
        REAL_PYTHON=sys.executable,
        STUB_LOG=str(log),
    )
    proc = subprocess.run(
        [str(bin_dir / "bash"), str(SETUP), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, log.read_text().splitlines()


def warmed(calls: list[str], imports: str) -> bool:
    """Whether the modules' bytecode was written (``imports``, the python command line) after
    the last install."""
    installs = [i for i, c in enumerate(calls) if c.startswith("-m pip install")]
    return imports in calls and calls.index(imports) > installs[-1]


def pip_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install") and "--dry-run" not in c]


@pytest.fixture
def cpu_index(tmp_path):
    """A local simple index that lists torch, served over HTTP."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    for release in ("2.13.0", "2.14.1"):
        (root / "torch" / f"torch-{release}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_text(
            ""
        )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_cpu_build_from_the_cpu_index_when_it_answers(tmp_path, cpu_index):
    out, calls = run_setup(tmp_path, cpu_index)
    installs = pip_installs(calls)
    assert installs[0].endswith(f"--extra-index-url {cpu_index} torch==2.13.0+cpu"), installs
    assert installs[1].endswith(f"-e {ROOT}[dev]"), installs
    # no byte-compilation of every installed module; the bytecode of what runs import, after
    assert all("--no-compile" in c for c in installs), installs
    assert warmed(calls, "-c import torch, torchtitan.train, muon_plugin.torchtitan, pytest")
    assert f"installing the CPU build torch==2.13.0+cpu from {cpu_index}" in out, out
    steps = [line for line in out.splitlines() if line.startswith("[setup_env]")]
    assert any("torchtitan==0.2.2" in line for line in steps), out  # what is being installed
    assert steps[-1].startswith("[setup_env] done in "), out


def test_pypi_with_a_size_note_when_the_cpu_index_is_unreachable(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, calls = run_setup(tmp_path, f"http://127.0.0.1:{port}")
    installs = pip_installs(calls)
    assert installs[0].endswith(" torch==2.13.0"), installs
    assert "--extra-index-url" not in installs[0]
    note = [line for line in out.splitlines() if "installing torch==2.13.0 from PyPI" in line]
    assert len(note) == 1 and "torch 2.13.0" in note[0], out
    assert any("--dry-run" in c for c in calls)


def test_download_size_summary():
    sys.path.insert(0, str(ROOT / "scripts"))
    import download_size

    report = {
        "install": [
            {"metadata": {"name": "torch", "version": "2.13.0"}, "download_info": {"url": u}}
            for u in ("file:///nonexistent/torch.whl",)
        ]
        + [
            {
                "metadata": {"name": "nvidia-cublas", "version": "13"},
                "download_info": {"url": Path(__file__).as_uri()},
            }
        ]
    }
    line = download_size.summarize(json.loads(json.dumps(report)))
    assert line.startswith("torch 2.13.0 (CUDA build) and 1 more packages"), line
    assert "1 of them NVIDIA/CUDA libraries" in line and "1 sizes unknown" in line, line


def test_titan03_environment_pins_torch_2_14(tmp_path, cpu_index):
    """torchtitan 0.3's environment: torch 2.14.1 (its pipeline schedules need 2.14's API)."""
    out, calls = run_setup(tmp_path, cpu_index, "--titan03")
    installs = pip_installs(calls)
    assert installs[0].endswith(f"--extra-index-url {cpu_index} torch==2.14.1+cpu"), installs
    assert installs[1].endswith(f"-e {ROOT}[torchtitan03]"), installs
    assert warmed(calls, "-c import torch, torchtitan.train, muon_plugin.torchtitan03, pytest")
    done = [line for line in out.splitlines() if line.startswith("[setup_env] done in ")]
    assert done and done[0].endswith(f"torch 2.14.1+cpu in {tmp_path / 'venv'}"), out


def test_a_venv_with_another_torch_release_gets_the_pinned_one(tmp_path, cpu_index):
    """A venv holding torch 2.13 (e.g. set up before the pin moved) is upgraded to the pin."""
    (tmp_path / "calls.log").write_text("-m pip install torch==2.13.0+cpu\n")
    out, calls = run_setup(tmp_path, cpu_index, "--titan03")
    assert "torch: 2.13.0+cpu installed, this environment pins 2.14.1" in out, out
    assert any(c.endswith("torch==2.14.1+cpu") for c in pip_installs(calls)), calls


def test_torchtune_environment_pins_torch_2_13(tmp_path, cpu_index):
    """torchtune 0.6.1's environment: torch 2.13.0 and the torchtune extra (torchao 0.15)."""
    out, calls = run_setup(tmp_path, cpu_index, "--torchtune")
    installs = pip_installs(calls)
    assert installs[0].endswith(f"--extra-index-url {cpu_index} torch==2.13.0+cpu"), installs
    assert installs[1].endswith(f"-e {ROOT}[torchtune]"), installs
    assert warmed(
        calls, "-c import torch, torchtune.training, torchao, muon_plugin.torchtune, pytest"
    )
    assert any("torchtune==0.6.1" in line for line in out.splitlines()), out
