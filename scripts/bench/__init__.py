"""The benchmark behind ``scripts/benchmark.py`` (the command users run), one module a job.

Set-up: ``config`` (sections, workloads, sizes, the row and workload selection), ``measure``
(timer, FLOP count, matmul peak, error), ``formatting`` (numbers and text tables).

Sections: ``kernels`` (the symmetric Gram kernel against cuBLAS), ``ortho`` (zeropower per
strategy, speed and accuracy) with ``accuracy`` (the fp64 references and the gradient-like
input), ``step`` (``optimizer.step()`` of every row on every workload, the memory columns too)
with ``memory`` (state bytes, CUDA memory probe).

What is timed: ``workloads`` (Llama-3-8B slice, GPT-125M), ``row`` (what a row is, and the
check that its patch ran), ``rows`` (ours, MuonLP, torch, the naive reference, fused AdamW, the
elementwise part), ``peers`` (dion, gram-newton-schulz, generic peers), ``ablations`` (the
patches some of our rows run under), ``reference`` (naive Newton-Schulz and Muon).

Report: ``tables`` (one table per section), ``summary`` (the closing summary), ``report``
(run facts, the RESULTS.md section, the ``--json`` file), ``runs`` (``--repeats`` and
``--merge``: medians with ranges over runs), ``cli`` (the command line, ``main``).
"""
