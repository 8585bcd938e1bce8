#!/usr/bin/env bash
# The one command of a GPU machine: the GPU tests, the README's main job through PYTHON=, and the
# benchmark, each under a time limit, ending in a summary of each part; everything under $OUT.
#
#   OUT=/path bash scripts/run_one_gpu.sh [PHASE ...]   # default: tests train bench
#
# tests    the tests that need a GPU (kernels, CUDA graphs, the fused MuonLP kernel, memory,
#          autotune tables, every benchmark row at small sizes, two gloo ranks on the one GPU,
#          NorMuon on the GPU paths, every backend against the plain loop through the step,
#          QK-Clip's FlexAttention max-logit path against the chunked one; the kernels' checks
#          in Triton's interpreter are left out, they are CPU tests):
#          tests.log                                                              TESTS_S (400)
# train    PYTHON=$PYTHON bash scripts/train.sh configs/llama3_debug_muon.toml, the main job
#          with no other variable set (TRAIN_ARGS: overrides to add): train.log, and the
#          run's own log folder copied to train_logs/                             TRAIN_S (90)
# bench    benchmark.py --no-compile, every section (SECTIONS to change) and every row but the
#          peers' (ROWS to change), REPEATS runs (default 1), each in its own process and
#          starting no step row once BENCH_S - 60 s have passed; bench<N>.json and .log, then
#          every run of $OUT (earlier calls' too) merged: bench.json, bench.txt   BENCH_S (170)
# compile  the MuonForeach(compile=True) row on GPT-125M (inductor: minutes): compile.json,
#          compile.log                                                          COMPILE_S (300)
# peers    the peers' rows alone (dion, gram-newton-schulz; their first steps autotune for
#          minutes): peers.json, peers.log                                        PEERS_S (500)
# spectrum scripts/update_spectrum.py: the largest singular value of Muon's update through the
#          optimizer's step on every backend, stress inputs, 30 steps (a path whose updates grow
#          fails): spectrum.log, spectrum.json                                  SPECTRUM_S (200)
# stability scripts/stability_check.py: the convergence model trained with Muon (lr 4e-3, a
#          150-step schedule) once per backend, the runs side by side; a run that diverges
#          fails it: stability/ (each run's train.log, stability.md), stability.log
#                                                                          STABILITY_S (500)
# tune     the symmetric kernel autotuned afresh on this GPU (no shipped table borrowed): the
#          table to ship in muon_plugin/kernels/tuned/ lands in $OUT/autotune/     TUNE_S (400)
#
# No phase starts with less than 20 s of TOTAL_S (default 590) left, and none runs past it, so
# the default phases end within 10 minutes; a phase cut by its limit keeps what it finished.
# The summary (scripts/one_gpu_summary.py) is printed and written to summary.txt: PASS, FAIL,
# CUT or NOT RUN per phase, its time, its logs and its key numbers; the exit status is 0 when
# every phase passed. PYTHON (default python3) runs everything. SMOKE=1: the same on a CPU
# (benchmark --quick; to check this script).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/outputs/one_gpu}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"   # a relative OUT is the caller's
cd "$ROOT"
PY="${PYTHON:-python3}"
PHASES="${*:-tests train bench}"
TOTAL_S="${TOTAL_S:-590}"
OURS="MuonForeach,Muon (per-parameter),MuonLP,torch.optim.Muon,naive,AdamW"
GPU_TESTS="tests/kernels/test_kernels.py tests/orthogonalize/test_cuda_graphs.py tests/orthogonalize/test_orthogonalize.py
    tests/orthogonalize/test_backends.py tests/lp/test_lp_int8.py tests/kernels/test_quantized_kernels.py
    tests/optimizer/test_step_memory.py tests/kernels/test_tuning_cache.py tests/scripts/test_benchmark_smoke.py
    tests/kernels/test_matrix_scale.py tests/distributed/test_two_ranks_one_gpu.py
    tests/optimizer/test_normuon_device.py tests/optimizer/test_backends_agree_device.py
    tests/kernels/test_row_factors_kernel.py tests/qk_clip/test_qk_clip_gpu.py"
if [[ "${SMOKE:-0}" == 1 ]]; then
    BENCH_ARGS=(--quick --device cpu)
    MERGE_ARGS=(--quick)
else
    BENCH_ARGS=(--device cuda)
    MERGE_ARGS=()
fi
[[ -n "${WORKLOADS:-}" ]] && BENCH_ARGS+=(--workloads "$WORKLOADS")
# Which code ran, whatever the checkout's git metadata says: a digest of the tracked-kind files
# under muon_plugin/ and scripts/ (the same command on another machine gives the same digest).
source_digest() {
    find muon_plugin scripts -type f \( -name '*.py' -o -name '*.sh' -o -name '*.json' \) \
        -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12
}
# What this script's own commands need (train.sh gets the caller's environment as it is).
run_py() { PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$@"; }

{ date -u; command -v nvidia-smi >/dev/null && nvidia-smi -L; "$PY" -c 'import sys, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "not importable"
print("torch", torch.__version__, "| triton", tv, "| Python", sys.version.split()[0])'
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(
      [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] && echo " + local changes")"
  echo "sources $(source_digest)"; } >"$OUT/machine.txt" 2>&1
echo "run_one_gpu: phases: $PHASES, out: $OUT, within $TOTAL_S s"
: >"$OUT/phases.tsv"
START=$SECONDS

for phase in $PHASES; do
    case "$phase" in
    tests) budget="${TESTS_S:-400}" ;;
    train) budget="${TRAIN_S:-90}" ;;
    bench) budget="${BENCH_S:-170}" ;;
    compile) budget="${COMPILE_S:-300}" ;;
    peers) budget="${PEERS_S:-500}" ;;
    spectrum) budget="${SPECTRUM_S:-200}" ;;
    stability) budget="${STABILITY_S:-500}" ;;
    tune) budget="${TUNE_S:-400}" ;;
    *) echo "unknown phase: $phase (tests, train, bench, compile, peers, spectrum, stability, tune)" >&2; continue ;;
    esac
    left=$((TOTAL_S - (SECONDS - START)))
    limit=$((budget < left ? budget : left))
    if [[ "$limit" -lt 20 ]]; then
        printf '%s\t-1\t0\t%s\n' "$phase" "$budget" >>"$OUT/phases.tsv"
        echo "phase $phase: not run, $left s of TOTAL_S left"
        continue
    fi
    echo "phase $phase: at most $limit s"
    t0=$SECONDS
    case "$phase" in
    tests)
        # shellcheck disable=SC2086  # the list of test files
        run_py timeout -k 5 "$limit" "$PY" -m pytest -q -ra -p no:cacheprovider --durations=15 \
            -m "not interpreter" ${TESTS:-$GPU_TESTS} >"$OUT/tests.log" 2>&1
        rc=$?
        ;;
    train)
        # shellcheck disable=SC2086  # TRAIN_ARGS: overrides, split on spaces
        PYTHON="$PY" timeout -k 5 "$limit" bash scripts/train.sh configs/llama3_debug_muon.toml \
            ${TRAIN_ARGS:-} >"$OUT/train.log" 2>&1
        rc=$?
        log_dir="$(sed -n 's/^train\.sh: log: \(.*\)\/train\.log .*/\1/p' "$OUT/train.log" | head -n 1)"
        rm -rf "$OUT/train_logs"
        [[ -n "$log_dir" && -d "$log_dir" ]] && cp -r "$log_dir" "$OUT/train_logs"
        ;;
    bench)
        n=1
        while [[ -e "$OUT/bench$n.json" ]]; do n=$((n + 1)); done
        rc=0
        for _ in $(seq "${REPEATS:-1}"); do
            left=$((limit - (SECONDS - t0)))
            [[ "$left" -lt 20 ]] && break
            run_py timeout -k 5 "$left" "$PY" scripts/benchmark.py "${BENCH_ARGS[@]}" --no-compile \
                --sections "${SECTIONS:-kernels,ortho,step,memory}" --rows "${ROWS:-$OURS}" \
                --budget $((left > 90 ? left - 60 : left / 2)) \
                --json "$OUT/bench$n.json" >"$OUT/bench$n.log" 2>&1
            r=$?
            echo "benchmark run $n rc=$r" | tee -a "$OUT/bench$n.log"
            [[ "$rc" == 0 ]] && rc=$r
            n=$((n + 1))
        done
        run_py "$PY" scripts/benchmark.py --merge "$OUT"/bench[0-9]*.json \
            ${MERGE_ARGS[@]+"${MERGE_ARGS[@]}"} --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
        ;;
    compile)
        run_py timeout -k 5 "$limit" "$PY" scripts/benchmark.py "${BENCH_ARGS[@]}" --compile \
            --sections step --rows "compile=true" --workloads "${WORKLOADS:-gpt}" \
            --json "$OUT/compile.json" >"$OUT/compile.log" 2>&1
        rc=$?
        ;;
    peers)
        run_py timeout -k 5 "$limit" "$PY" scripts/benchmark.py "${BENCH_ARGS[@]}" --no-compile \
            --sections step,memory --rows "dion,gram_newton_schulz,MuonForeach (polar" \
            --budget $((limit > 120 ? limit - 100 : limit / 2)) --json "$OUT/peers.json" \
            >"$OUT/peers.log" 2>&1
        rc=$?
        ;;
    spectrum)
        spectrum_args=()
        [[ "${SMOKE:-0}" == 1 ]] && spectrum_args=(--div 16 --steps 6 --device cpu)
        run_py timeout -k 5 "$limit" "$PY" scripts/update_spectrum.py ${spectrum_args[@]+"${spectrum_args[@]}"} \
            --json "$OUT/spectrum.json" >"$OUT/spectrum.log" 2>&1
        rc=$?
        ;;
    stability)
        stability_args=(--timeout $((limit > 60 ? limit - 30 : limit)))
        [[ "${SMOKE:-0}" == 1 ]] && stability_args=(--dry-run)
        PYTHON="$PY" run_py timeout -k 40 "$limit" "$PY" scripts/stability_check.py \
            "${stability_args[@]}" --out "$OUT/stability" >"$OUT/stability.log" 2>&1
        rc=$?
        ;;
    tune)
        MUON_PLUGIN_AUTOTUNE_CACHE=own MUON_PLUGIN_CACHE_DIR="$OUT/autotune" \
            run_py timeout -k 5 "$limit" "$PY" scripts/benchmark.py "${BENCH_ARGS[@]}" \
            --no-compile --sections kernels,step --rows "MuonForeach (polar" >"$OUT/tune.log" 2>&1
        rc=$?
        ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$phase" "$rc" $((SECONDS - t0)) "$limit" >>"$OUT/phases.tsv"
    echo "phase $phase: exit $rc in $((SECONDS - t0)) s"
done
run_py "$PY" scripts/one_gpu_summary.py "$OUT"
