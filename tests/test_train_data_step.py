"""scripts/train.sh with the user's own Python (``PYTHON=``) and torch: the data step.

The user's Python here is a wrapper around this one that reports torch 2.11.0 to
scripts/prepare_data.py (its version reader faked) and records the torchrun command instead of
training (the training itself is what tests/test_torchtitan_run.py runs), so each case takes
the seconds of the config check. Checked: the local corpus is built only when the job reads a
path in DATA_DIR; from other releases than the pinned ones the build is one warning, never a
refusal, and a second run uses what it built; a DATA_DIR built by the pinned environment is
used as it is, with one line saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama3_debug_muon.toml"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bash scripts run on Linux")

SHIM = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("prepare_data", {script!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
real = module.installed_release
module.installed_release = lambda name: "2.11.0" if name == "torch" else real(name)
sys.exit(module.main(sys.argv[1:]))
"""
WRAPPER = """\
#!/usr/bin/env bash
# A user's python: torch 2.11.0 as scripts/prepare_data.py sees it; torchrun only recorded.
if [[ "$1 $2" == "-m torch.distributed.run" ]]; then echo "TORCHRUN $*"; exit 0; fi
if [[ "$1" == scripts/prepare_data.py ]]; then shift; exec {python} {shim} "$@"; fi
exec {python} "$@"
"""


@pytest.fixture(scope="module")
def user_python(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("user_python")
    shim = tmp / "prepare_data_torch_2_11.py"
    shim.write_text(SHIM.format(script=str(ROOT / "scripts" / "prepare_data.py")))
    wrapper = tmp / "python"
    wrapper.write_text(WRAPPER.format(python=sys.executable, shim=shim))
    wrapper.chmod(0o755)
    return wrapper


def start(python: Path, data_dir: Path, reads: Path, dump: Path) -> subprocess.Popen:
    """``PYTHON=python DATA_DIR=data_dir train.sh CONFIG`` with the job reading ``reads``."""
    env = dict(os.environ, PYTHON=str(python), DATA_DIR=str(data_dir), NPROC="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("SKIP_PREPARE_DATA", "OMP_NUM_THREADS"):
        env.pop(name, None)
    args = ["--job.dump_folder", str(dump), "--training.dataset_path", str(reads / "corpus")]
    args += ["--model.hf_assets_path", str(reads / "tokenizer")]
    cmd = ["bash", "scripts/train.sh", str(CONFIG), *args]
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, **out)


def finish(proc: subprocess.Popen) -> list[str]:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert any(line.startswith("TORCHRUN -m torch.distributed.run") for line in out.splitlines())
    return out.splitlines()


def data_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("[train] data", "[prepare_data]"))]


def test_data_is_built_only_when_read_and_other_releases_never_refuse(
    user_python: Path, tmp_path: Path
) -> None:
    pinned = tmp_path / "pinned"  # the project's environment built this data/ (this python)
    subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", str(pinned), "-q"],
                   cwd=ROOT, check=True, timeout=300)  # fmt: skip
    new, unread = tmp_path / "new", tmp_path / "unread"
    procs = {
        "reuse": start(user_python, pinned, pinned, tmp_path / "run1"),
        "build": start(user_python, new, new, tmp_path / "run2"),
        "unread": start(user_python, unread, pinned, tmp_path / "run3"),
    }
    lines = {name: finish(proc) for name, proc in procs.items()}

    (reuse_cmd, reused) = data_lines(lines["reuse"])
    assert reuse_cmd == f"[train] data: scripts/prepare_data.py --out {pinned}"
    assert reused.startswith(f"[prepare_data] {pinned} is up to date: corpus sha256 ")
    assert reused.endswith(
        ", built from torch 2.13.0, torchtitan 0.2.2, used as it is (this environment: torch "
        "2.11.0, torchtitan 0.2.2; --force rebuilds it)"
    )
    log = next((tmp_path / "run1" / "logs").glob("*/train.log")).read_text()
    assert reused in log  # the run's log keeps the line

    built = data_lines(lines["build"])
    assert built[1].startswith("[prepare_data] warning: torch 2.11.0 (pinned: 2.13.0): ")
    assert built[2].startswith(f"[prepare_data] {new}: corpus sha256 ")
    again = data_lines(finish(start(user_python, new, new, tmp_path / "run4")))
    assert again[1].startswith(f"[prepare_data] {new} is up to date: ")
    assert again[1].endswith("(from torch 2.11.0, torchtitan 0.2.2)")

    assert data_lines(lines["unread"]) == [
        f"[train] data: the job reads nothing in {unread}, so scripts/prepare_data.py is not run"
    ]
    assert not unread.exists()
