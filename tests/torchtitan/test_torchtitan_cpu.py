"""CPU mode (muon_plugin.torchtitan.cpu_mode): applied early enough, in every module that
needs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]

# What `python -m torchtitan.train --job.config_file X` does before the Trainer exists:
# torchtitan.train's imports, then the config parse that imports the custom config module.
PROBE = textwrap.dedent(
    """
    import json, sys
    import torchtitan.train  # noqa: F401  (its imports copy device_type / device_module)
    from torchtitan.config import ConfigManager
    ConfigManager().parse_args(["--job.custom_config_module", "muon_plugin.torchtitan"])
    from torchtitan.protocols.train_spec import get_train_spec
    get_train_spec("llama4")  # imports the model packages and distributed.dual_pipe_v late
    names = [
        "torchtitan.tools.utils",
        "torchtitan.distributed.utils",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.components.metrics",
        "torchtitan.tools.profiling",
        "torchtitan.distributed.dual_pipe_v",
    ]
    out = {}
    for n in names:
        m = sys.modules[n]
        out[n] = [getattr(m, "device_type", None), repr(getattr(m, "device_module", None))]
    from torchtitan.tools import utils
    out["get_device_info"] = [utils.get_device_info()[0]]
    from torchtitan.components.metrics import build_device_memory_monitor
    mon = build_device_memory_monitor()
    out["monitor"] = [mon.device_name, mon.get_peak_stats().max_reserved_gib > 0]
    import subprocess
    def no_lspci(*args, **kwargs):  # what a PATH with an unreadable folder gives
        raise PermissionError("lspci")
    subprocess.run = no_lspci
    out["peak_flops"] = [utils.get_peak_flops("CPU")]
    print("PROBE" + json.dumps(out))
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode only applies without GPUs")
def test_cpu_mode_reaches_every_module_in_torchtitan_import_order() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE"))
    got = json.loads(line[len("PROBE") :])
    stand_in = "<muon_plugin CPU stand-in for torch.cuda>"
    for name in ("torchtitan.tools.utils", "torchtitan.distributed.utils"):
        assert got[name] == ["cpu", stand_in], (name, got[name])
    assert got["torchtitan.distributed.parallel_dims"][0] == "cpu"
    assert got["torchtitan.components.metrics"] == ["cpu", stand_in]
    assert got["torchtitan.tools.profiling"][1] == stand_in
    assert got["torchtitan.distributed.dual_pipe_v"] == ["cpu", stand_in]
    assert got["get_device_info"] == ["cpu"]
    assert got["monitor"][0].startswith("CPU") and got["monitor"][1] is True
    assert got["peak_flops"] == [312e12]  # no lspci on the CPU


def test_fsdp_sum_reduction_only_on_cpu() -> None:
    import muon_plugin.torchtitan
    from muon_plugin.torchtitan import cpu_mode as cpu

    muon_plugin.torchtitan.activate()

    if not cpu.is_applied():
        pytest.skip("an accelerator is present: CPU mode is off")
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as c

    class Group:
        def size(self) -> int:
            return 2

    # torchtitan passes a divide factor (1.0 with its loss scaling): PREMUL_SUM on CUDA ...
    on_cuda = c._get_gradient_divide_factors(Group(), None, torch.float32, "cuda", 1.0)
    assert on_cuda[0] is None and on_cuda[1] is None and on_cuda[2] != ReduceOp.SUM
    # ... plain SUM (+ the same post-division) on CPU, which gloo supports
    on_cpu = c._get_gradient_divide_factors(Group(), None, torch.float32, "cpu", 1.0)
    assert on_cpu[2] == ReduceOp.SUM and on_cpu[3] == ReduceOp.SUM and on_cpu[1] == 1.0
    cpu.apply()  # idempotent
    assert getattr(c._get_gradient_divide_factors, "_muon_plugin_cpu", False)


def test_moe_histc_accepts_integer_cpu_tensors() -> None:
    import muon_plugin.torchtitan
    from muon_plugin.torchtitan import cpu_mode as cpu

    muon_plugin.torchtitan.activate()

    if not cpu.is_applied():
        pytest.skip("an accelerator is present: CPU mode is off")
    from torchtitan.models.moe import moe

    idx = torch.tensor([0, 3, 3, 1, 7, 3], dtype=torch.int64)
    counts = moe.torch.histc(idx, bins=8, min=0, max=8)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [1, 1, 0, 3, 0, 0, 0, 1]
    assert moe.torch.Tensor is torch.Tensor  # everything else is torch itself
