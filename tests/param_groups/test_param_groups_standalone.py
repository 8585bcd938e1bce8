"""The release-independent pieces import and work without torchtitan installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import sys

    class NoTorchtitan:  # as if torchtitan were not installed
        def find_spec(self, name, path=None, target=None):
            if name == "torchtitan" or name.startswith("torchtitan."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoTorchtitan())
    import torch
    from muon_plugin.adapter import build_job_optimizers
    from muon_plugin.param_groups import builder, options, rules, table
    import muon_plugin.torchtitan  # the 0.2.2 package itself imports nothing of torchtitan
    import muon_plugin.torchtitan03

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = table.apply_table(options.MuonConfig(), {"ns_steps": 3})
    base = builder.BaseHyperparams(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    print(build_job_optimizers([model], cfg, base).format_build_summary())
    assert not any(m.startswith("torchtitan") for m in sys.modules)
    print("OK")
    """
)


def test_param_groups_import_without_torchtitan() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout and "x3" in proc.stdout and "matrix" in proc.stdout
