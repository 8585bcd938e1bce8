#!/usr/bin/env bash
# The project's test command: set up ./.venv (torchtitan 0.2.2, scripts/setup_env.sh),
# ./.venv-titan03 (torchtitan 0.3, scripts/setup_env.sh --titan03) and ./.venv-torchtune
# (torchtune 0.6.1, scripts/setup_env.sh --torchtune), then run pytest in each: everything in
# ./.venv (tests/titan03 and tests/torchtune are skipped there), tests/titan03 in
# ./.venv-titan03, tests/torchtune in ./.venv-torchtune.
#
# Set-up first, before any test: ./.venv in the foreground while ./.venv-titan03 is set up
# beside it (its own torch; its log is printed when it is done), then ./.venv-torchtune (it
# shares ./.venv's packages). Set-up is mostly one core's work (pip), so the two overlap well;
# beside running tests it would get a share of a core for many minutes. Then the tests: ./.venv's
# end-to-end runs (the tests marked slow: training runs and the convergence smoke run) as the
# background job "e2e", tests/titan03 and tests/torchtune as background jobs too, ./.venv's
# other tests in the foreground. The background jobs run at a lower CPU priority (nice 10), so
# the foreground's progress lines keep coming; they log to .test-logs/<job>.log, each log is
# printed when the foreground tests are done, and a line a minute says which are still running.
# Extra arguments go to every pytest run, e.g. `bash scripts/test.sh -k distributed`.
# MUON_PLUGIN_TITAN03=0 skips the torchtitan 0.3 environment, MUON_PLUGIN_TORCHTUNE=0 the
# torchtune one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$SECONDS
logs="$root/.test-logs"
mkdir -p "$logs"
venv="${MUON_PLUGIN_VENV:-$root/.venv}"
venv_titan03="${MUON_PLUGIN_VENV_TITAN03:-$root/.venv-titan03}"
venv_torchtune="${MUON_PLUGIN_VENV_TORCHTUNE:-$root/.venv-torchtune}"
titan03="${MUON_PLUGIN_TITAN03:-1}"
torchtune="${MUON_PLUGIN_TORCHTUNE:-1}"

titan03_setup=0
if [ "$titan03" != 0 ]; then
    echo "[test] environment: scripts/setup_env.sh --titan03, beside the next (log: $logs/setup-titan03.log)"
    bash scripts/setup_env.sh --titan03 >"$logs/setup-titan03.log" 2>&1 &
    titan03_setup=$!
    # if ./.venv's set-up fails (the script ends there), this one ends too
    trap 'kill "$titan03_setup" 2>/dev/null || true' EXIT
fi
echo "[test] environment: scripts/setup_env.sh"
bash scripts/setup_env.sh
torchtune_ok=1
if [ "$torchtune" != 0 ]; then
    echo "[test] environment: scripts/setup_env.sh --torchtune"
    bash scripts/setup_env.sh --torchtune || { torchtune_ok=0; echo "[test] torchtune: set-up failed"; }
fi
titan03_ok=1
if [ "$titan03" != 0 ]; then
    while kill -0 "$titan03_setup" 2>/dev/null; do
        sleep 5
        if kill -0 "$titan03_setup" 2>/dev/null && (( (SECONDS - start) % 60 < 5 )); then
            echo "[test] still setting up .venv-titan03 ($((SECONDS - start)) s): $(tail -n 1 "$logs/setup-titan03.log" | cut -c1-120)"
        fi
    done
    wait "$titan03_setup" || titan03_ok=0
    echo "[test] ---- scripts/setup_env.sh --titan03 (its log) ----"
    cat "$logs/setup-titan03.log"
    [ "$titan03_ok" = 1 ] || echo "[test] titan03: set-up failed"
fi
echo "[test] environments set up in $((SECONDS - start)) s"

# The project's own modules, compiled once: every test process (training workers, scripts)
# reads the bytecode instead of compiling them again, also where PYTHONDONTWRITEBYTECODE keeps
# Python from writing it (about 0.2 s per process; __pycache__ is ignored by git).
echo "[test] bytecode: compileall muon_plugin scripts configs tests"
"$venv/bin/python" -m compileall -q -j 0 muon_plugin scripts configs tests >/dev/null

# "NAME OK VENV TESTS": a background job, whether its environment was set up (1) or not (0),
# that environment's folder and pytest's arguments (split at spaces).
extra_envs=("e2e 1 $venv -m slow")
[ "$titan03" != 0 ] && extra_envs+=("titan03 $titan03_ok $venv_titan03 tests/titan03")
[ "$torchtune" != 0 ] && extra_envs+=("torchtune $torchtune_ok $venv_torchtune tests/torchtune")

# extra_job NAME OK VENV TESTS ARGS...: run one environment's tests (in the background, at
# nice 10); exit 3 when its set-up failed, else pytest's status (5, nothing selected, counts
# as 0).
extra_job() {
    local name="$1" ok="$2" env_dir="$3" tests="$4"
    shift 4
    # a lower CPU priority for the job and all it starts: the foreground's many short tests
    # keep their core, and their progress lines keep coming
    renice -n 10 -p "$BASHPID" >/dev/null 2>&1 || true
    if [ "$ok" != 1 ]; then
        echo "[test] $name: not run, its environment's set-up failed"
        return 3
    fi
    echo "[test] $name: $env_dir/bin/python -m pytest --durations=15 $tests $*"
    local rc=0
    # shellcheck disable=SC2086  # $tests: pytest's arguments, split at spaces
    MUON_PLUGIN_PYTHON_022="$venv/bin/python" "$env_dir/bin/python" -m pytest --durations=15 $tests "$@" \
        || rc=$?
    [ "$rc" = 5 ] && rc=0
    return "$rc"
}

declare -A job_pid=()
for entry in "${extra_envs[@]}"; do
    read -r name ok env_dir tests <<<"$entry"
    echo "[test] $name: tests in the background (log: $logs/$name.log)"
    extra_job "$name" "$ok" "$env_dir" "$tests" "$@" >"$logs/$name.log" 2>&1 &
    job_pid[$name]=$!
done

# A line a minute while background jobs run (the foreground tests print their own progress).
(
    while sleep 60; do
        running=()
        for name in "${!job_pid[@]}"; do
            kill -0 "${job_pid[$name]}" 2>/dev/null && running+=("$name")
        done
        [ "${#running[@]}" = 0 ] && break
        echo "[test] in the background, still running: ${running[*]} ($((SECONDS - start)) s)"
    done
) &
ticker=$!

status=0
echo "[test] $venv/bin/python -m pytest -m 'not slow' --durations=20 $*"
"$venv/bin/python" -m pytest -m "not slow" --durations=20 "$@" || status=$?

for entry in "${extra_envs[@]}"; do
    read -r name _ _ _ <<<"$entry"
    rc=0
    wait "${job_pid[$name]}" || rc=$?
    echo "[test] ---- $name (its log, $logs/$name.log) ----"
    cat "$logs/$name.log"
    echo "[test] $name: exit $rc"
    [ "$rc" != 0 ] && status=$rc
done
kill "$ticker" 2>/dev/null || true
echo "[test] all done in $((SECONDS - start)) s, exit $status"
exit "$status"
