#!/usr/bin/env bash
# The multi-GPU checks on one machine (NCCL, one process per GPU); everything lands under $OUT.
#
#   OUT=/path bash scripts/run_multi_gpu.sh [tests] [scaling] [titan]     # default: all three
#
# tests    (a) NCCL parity tests, one job per layout and world size (2,4,8 up to the GPUs):
#              tests.log (pytest -v), per-layout pass/fail table in RESULTS.md
# scaling  (b) scripts/bench_scaling.py: Llama-3-8B matrices, FSDP and FSDP x TP, N = 1,8,4,2
#              (N = 8 right after the baseline): scaling.log, scaling.json
# titan    (c) scripts/bench_titan_tps.py: configs/llama3_8b_muon.toml on all GPUs with AdamW
#              and with Muon, local corpus/tokenizer: titan.log, titan/{AdamW,muon}.log
# Each phase writes its marked section of $OUT/RESULTS.md as it goes. Time budgets in seconds
# (TESTS_S=230 SCALING_S=160 TITAN_S=180; about 10 minutes in all with the install);
# a phase cut by its budget keeps what it finished. PYTHON (default python3) runs everything;
# when torchtitan or pytest is missing (an offline machine), the wheels in .whl/ are
# installed into /tmp/site.
# SMOKE=1: the same on CPU (gloo, 2 ranks, tiny shapes, the debug model) to check this script.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/outputs/multi_gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PHASES="${*:-tests scaling titan}"
RES="$OUT/RESULTS.md"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if ! "$PY" -c "import torchtitan, pytest" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$OUT/install.log" 2>&1 || echo "wheel install failed" >&2
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHON="$PY"   # train.sh: use this interpreter, no venv set-up
NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if [[ "${SMOKE:-0}" == 1 ]]; then
    BACKEND=gloo DEVICE=cpu NGPU=2 CONFIG=configs/llama3_debug_muon.toml
    export MUON_TEST_PER_LAYOUT=1
    SCALE_ARGS=(--dim-div 32 --layers 2)
    TITAN_ARGS=(--nproc 2)
else
    BACKEND=nccl DEVICE=cuda CONFIG=configs/llama3_8b_muon.toml
    SCALE_ARGS=()
    TITAN_ARGS=()
fi
{ date -u; command -v nvidia-smi >/dev/null && nvidia-smi -L; "$PY" -c 'import torch
print("torch", torch.__version__, "| GPUs:", torch.cuda.device_count())'; } >"$OUT/machine.txt" 2>&1
echo "run_multi_gpu: $NGPU GPU(s), phases: $PHASES, out: $OUT"
sizes() { local s=""; for n in "$@"; do [[ $n -le $NGPU ]] && s+="$n,"; done; echo "${s%,}"; }

for phase in $PHASES; do
    t0=$SECONDS
    case "$phase" in
    tests)
        if "$PY" -c "import pytest" 2>/dev/null; then
            MUON_TEST_BACKEND=$BACKEND MUON_TEST_WORLD_SIZES="$(sizes 2 4 8)" \
                timeout -k 15 "${TESTS_S:-230}" "$PY" -m pytest -v -rA -p no:cacheprovider \
                tests/distributed/test_distributed_plan.py tests/distributed/test_distributed.py \
                tests/distributed/test_distributed_checkpoint.py >"$OUT/tests.log" 2>&1
            echo "pytest rc=$?" >>"$OUT/tests.log"
        else
            echo "pytest is not installed: phase tests skipped" | tee "$OUT/tests.log"
        fi
        # The per-job lines of `pytest -v` (complete even when the budget cut the run).
        "$PY" - "$OUT/tests.log" "$RES" "$OUT/machine.txt" "$BACKEND" <<'EOF'
import re
import sys

sys.path.insert(0, "scripts")
from results_md import replace_section

log, res, machine, backend = sys.argv[1:5]
text = open(log).read()
found = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, re.M)
jobs = [(t.split("::", 1)[1], s) for t, s in found if "plan.py" not in t]
unit = [s for t, s in found if "plan.py" in t]
kinds = ("PASSED", "FAILED", "SKIPPED", "ERROR")
counts = ", ".join(f"{sum(s == k for _, s in found)} {k.lower()}" for k in kinds)
rc = (re.findall(r"pytest rc=(\d+)", text) or ["?"])[-1]
cut = " (cut by the TESTS_S budget: jobs not listed did not run)" if rc == "124" else ""
start, end = "<!-- multi_gpu_tests:start -->", "<!-- multi_gpu_tests:end -->"
rows = [f"| `{t}` | {s} |" for t, s in jobs]
lines = [
    start, f"## Distributed parity on {backend.upper()} (scripts/run_multi_gpu.sh tests)", "",
    open(machine).read().strip().replace("\n", "; ") + ".", "",
    f"MUON_TEST_BACKEND={backend}, one job per layout and world size: {counts}; pytest rc "
    f"{rc}{cut}. Planner unit tests (no processes): {unit.count('PASSED')}/{len(unit)} passed. "
    "The update differences from one process (GPU parity lines) are in tests.log.", "",
    "| job (world size - layout) | result |", "| --- | --- |", *rows, end, "",
]
replace_section(res, "\n".join(lines), start, end)
print("\n".join(rows))
EOF
        ;;
    scaling)
        timeout -k 15 "${SCALING_S:-160}" "$PY" scripts/bench_scaling.py --device "$DEVICE" \
            --world-sizes "$(sizes 1 8 4 2)" --steps "${SCALING_STEPS:-6}" --warmup 2 \
            "${SCALE_ARGS[@]}" --results "$RES" --json "$OUT/scaling.json" >"$OUT/scaling.log" 2>&1
        echo "bench_scaling rc=$?" >>"$OUT/scaling.log"
        ;;
    titan)
        budget="${TITAN_S:-180}"
        timeout -k 15 "$budget" "$PY" scripts/bench_titan_tps.py "$CONFIG" "${TITAN_ARGS[@]}" \
            --local-data --steps "${TITAN_STEPS:-10}" --skip 3 --timeout $((budget / 2 - 5)) \
            --log-dir "$OUT/titan" --results "$RES" --json "$OUT/titan.json" \
            >"$OUT/titan.log" 2>&1
        echo "bench_titan_tps rc=$?" >>"$OUT/titan.log"
        ;;
    *) echo "unknown phase: $phase (tests, scaling, titan)" >&2 ;;
    esac
    echo "phase $phase: $((SECONDS - t0)) s" | tee -a "$OUT/phases.txt"
done
[[ -f "$RES" ]] && cat "$RES"
exit 0
