#!/usr/bin/env python
"""Benchmark muon_plugin: symmetric kernels, the orthogonalization loop, optimizer.step(), memory.

One run, one process (``--repeats N``: N runs, each in its own process, every figure reported
as the median of the runs with their range; ``--merge A.json B.json ...``: the same report from
runs saved earlier with ``--json``). Sections (``--sections``, default all):

1. ``kernels``: the Triton symmetric Gram kernel ``symmetric_matmul(X)`` against cuBLAS
   ``X @ X.mT`` (bf16), what the ``gram`` dispatcher picks and whether it is ever slower than
   cuBLAS, and the epilogue form ``c * A @ A + b * A`` on the square Gram matrices.
2. ``ortho``: ``zeropower`` per strategy (polar_express, newton_schulz; 5 steps; turbo_muon,
   4 steps), ms and achieved
   TFLOP/s (plain-matmul count: ``4 m^2 n + 2 m^3`` per step, m <= n) against a bf16 matmul
   peak measured in the same run; accuracy: relative distance to the fp64 iteration and to the
   exact polar factor (fp64) on a Gaussian and on a low-rank-plus-noise input, each path
   checked against the plain bf16 loop (never farther from the polar factor).
3. ``step``: ``optimizer.step()`` on a 4-layer Llama-3-8B slice (28 matrices, 0.87 B params) and
   a GPT-125M (72 matrices), fp32 params and grads: ours (MuonForeach, with NorMuon's row
   normalization too, Muon, MuonLP int8 and int4 at default settings, compiled), torch's Muon,
   a naive per-parameter reference Muon, fused AdamW, the elementwise part of our step alone,
   and any importable peer at its fastest documented settings (dion's Muon with gram
   Newton-Schulz or its Triton kernels, inside its CUDA-graph wrapper; gram-newton-schulz's
   Muon; muonium; dtensor_muon); then the Llama slice
   with bf16 params and grads (what FSDP's mixed precision with bf16 parameters hands over)
   for a few of those rows.
4. ``memory``: optimizer-state bytes (per parameter) and the peak memory above params and grads
   over building the optimizer and all its steps (CUDA-graph pools included), also in units of
   the state; the transient peak of one steady step and of the first step; what stays
   allocated between steps besides the state (CUDA-graph pools; static inputs, library
   workspaces and other allocations).

On a CUDA GPU the full sizes are used (``--quick``: small ones); on the CPU small shapes (matrix
dims / 16, fewer layers) so the whole run takes well under a minute, and the Triton-only columns
are skipped. Timing: ``triton.testing.do_bench`` medians (CUDA events when triton is missing),
``optimizer.step()`` timed step by step with CUDA events after warm-up (median);
``time.perf_counter`` medians on the CPU.

    python scripts/benchmark.py [--quick] [--sections kernels,ortho,step,memory]
        [--results RESULTS.md] [--json rows.json] [--device auto|cpu|cuda] [--repeats N]
        [--rows WORD,WORD] [--workloads llama,gpt,llama-bf16] [--budget SECONDS]
    python scripts/benchmark.py --merge run1.json run2.json run3.json [--results RESULTS.md]

Prints its tables; only with ``--results PATH`` does it write them, into its own section of
that file (between ``<!-- benchmark:start -->`` and ``<!-- benchmark:end -->``), keeping
everything else in the file.

The code is the package ``scripts/bench/``, one module per job (its ``__init__.py`` lists them):
the rows in ``rows.py`` (the peers' in ``peers.py``), the workloads in ``workloads.py``, one
module per section, the report in ``tables.py``, ``summary.py`` and ``report.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))  # muon_plugin, from this checkout
sys.path.insert(0, str(SCRIPTS))  # the bench package and results_md

from bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
