#!/usr/bin/env bash
# The one-GPU checks: the GPU-only tests and scripts/benchmark.py; everything lands under $OUT.
#
#   OUT=/path bash scripts/run_one_gpu.sh [tests] [bench] [peers] [tune]   # default: tests bench
#
# tests  the tests that need a GPU (kernels, CUDA graphs, the fused MuonLP kernel, memory,
#        autotune tables): tests.log
# bench  benchmark.py --sections step,memory, REPEATS runs (default 1), each in its own process
#        and each stopped from starting rows after BENCH_S seconds (default 400), on our rows
#        and the torch references (ROWS overrides the selection); bench<N>.json and .log; with
#        all runs of $OUT (earlier calls' too) merged into bench.txt (medians and ranges)
# peers  the peers' rows alone (dion, gram-newton-schulz; their first steps autotune for
#        minutes), stopped after PEERS_S seconds (default 500): peers.json, peers.log
# tune   the symmetric kernel autotuned afresh on this GPU (no shipped table borrowed): the
#        table to ship for it in muon_plugin/kernels/tuned/ lands in $OUT/autotune/
# Every phase keeps what it finished when a budget cuts it. PYTHON (default python3) runs
# everything; WORKLOADS (e.g. gpt) limits bench and peers to those workloads. SMOKE=1: the
# same on a CPU with --quick (to check this script).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/outputs/one_gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PHASES="${*:-tests bench}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OURS="MuonForeach,Muon (per-parameter),MuonLP,torch.optim.Muon,naive,AdamW"
if [[ "${SMOKE:-0}" == 1 ]]; then
    BENCH_ARGS=(--quick --device cpu)
    MERGE_ARGS=(--quick)
else
    BENCH_ARGS=(--no-compile --device cuda)
    MERGE_ARGS=()
fi
[[ -n "${WORKLOADS:-}" ]] && BENCH_ARGS+=(--workloads "$WORKLOADS")
{ date -u; command -v nvidia-smi >/dev/null && nvidia-smi -L; "$PY" -c 'import torch, triton
print("torch", torch.__version__, "| triton", triton.__version__)'; git rev-parse --short HEAD; } \
    >"$OUT/machine.txt" 2>&1
echo "run_one_gpu: phases: $PHASES, out: $OUT"

for phase in $PHASES; do
    t0=$SECONDS
    case "$phase" in
    tests)
        timeout -k 15 "${TESTS_S:-240}" "$PY" -m pytest -q -ra -p no:cacheprovider \
            tests/test_kernels.py tests/test_cuda_graphs.py tests/test_orthogonalize.py \
            tests/test_backends.py tests/test_lp_int8.py tests/test_quantized_kernels.py \
            tests/test_step_memory.py tests/test_tuning_cache.py tests/test_benchmark_smoke.py \
            tests/test_matrix_scale.py \
            >"$OUT/tests.log" 2>&1
        echo "pytest rc=$?" | tee -a "$OUT/tests.log"
        ;;
    bench)
        for _ in $(seq "${REPEATS:-1}"); do
            n=1
            while [[ -e "$OUT/bench$n.json" ]]; do n=$((n + 1)); done
            timeout -k 15 $(("${BENCH_S:-400}" + 120)) "$PY" scripts/benchmark.py \
                "${BENCH_ARGS[@]}" --sections step,memory --rows "${ROWS:-$OURS}" \
                --budget "${BENCH_S:-400}" --json "$OUT/bench$n.json" >"$OUT/bench$n.log" 2>&1
            echo "benchmark run $n rc=$?" | tee -a "$OUT/bench$n.log"
        done
        "$PY" scripts/benchmark.py --merge "$OUT"/bench[0-9]*.json \
            ${MERGE_ARGS[@]+"${MERGE_ARGS[@]}"} >"$OUT/bench.txt" 2>&1
        ;;
    peers)
        timeout -k 15 $(("${PEERS_S:-500}" + 120)) "$PY" scripts/benchmark.py "${BENCH_ARGS[@]}" \
            --sections step,memory --rows "dion,gram_newton_schulz,MuonForeach (polar" \
            --budget "${PEERS_S:-500}" --json "$OUT/peers.json" >"$OUT/peers.log" 2>&1
        echo "peers rc=$?" | tee -a "$OUT/peers.log"
        ;;
    tune)
        MUON_PLUGIN_AUTOTUNE_CACHE=own MUON_PLUGIN_CACHE_DIR="$OUT/autotune" \
            timeout -k 15 "${TUNE_S:-400}" "$PY" scripts/benchmark.py "${BENCH_ARGS[@]}" \
            --sections kernels,step --rows "MuonForeach (polar" >"$OUT/tune.log" 2>&1
        echo "tune rc=$?" | tee -a "$OUT/tune.log"
        ;;
    *) echo "unknown phase: $phase (tests, bench, peers, tune)" >&2 ;;
    esac
    echo "phase $phase: $((SECONDS - t0)) s" | tee -a "$OUT/phases.txt"
done
exit 0
