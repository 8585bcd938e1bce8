#!/usr/bin/env bash
# The project's test command: set up ./.venv (torchtitan 0.2.2, scripts/setup_env.sh),
# ./.venv-titan03 (torchtitan 0.3, scripts/setup_env.sh --titan03) and ./.venv-torchtune
# (torchtune 0.6.1, scripts/setup_env.sh --torchtune), then run pytest in each: everything in
# ./.venv (tests/titan03 and tests/torchtune are skipped there), tests/titan03 in
# ./.venv-titan03, tests/torchtune in ./.venv-torchtune.
#
# ./.venv is set up first, in the foreground (./.venv-torchtune shares its packages). Then
# ./.venv's end-to-end runs (the tests marked slow: training runs and the convergence smoke
# run) run in the background as the job "e2e", and each other environment is set up and its
# tests run in the background too, while ./.venv's other tests run in the foreground. A job's
# set-up (pip: mostly disk and one core) runs at the foreground's priority; its tests run at a
# lower one (nice 10), so the foreground's progress lines keep coming. (At nice 10 beside the
# tests, the torchtitan 0.3 set-up took 754 s instead of about 65; set up before the tests,
# beside ./.venv's, the two slowed each other on the disk: 198 s for both.) The background
# jobs log to .test-logs/<job>.log; each log is printed when the foreground tests are done,
# and a line a minute says which background jobs are still running.
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

echo "[test] environment: scripts/setup_env.sh"
bash scripts/setup_env.sh

# The project's own modules, compiled once: every test process (training workers, scripts)
# reads the bytecode instead of compiling them again, also where PYTHONDONTWRITEBYTECODE keeps
# Python from writing it (about 0.2 s per process; __pycache__ is ignored by git).
echo "[test] bytecode: compileall muon_plugin scripts configs tests"
"$venv/bin/python" -m compileall -q -j 0 muon_plugin scripts configs tests >/dev/null
# The environments are installed without pip's byte-compilation of every module
# (scripts/setup_env.sh): a module none of its warm-up imports reached gets its bytecode written
# by the first test process that imports it, not compiled again by each of the hundreds that do.
unset PYTHONDONTWRITEBYTECODE

# "NAME FLAG VENV TESTS": a background job, the set-up flag of its environment ("-": ./.venv,
# set up above), that environment's folder and pytest's arguments (split at spaces).
extra_envs=("e2e - $venv -m slow")
[ "$titan03" != 0 ] && extra_envs+=("titan03 --titan03 $venv_titan03 tests/titan03")
[ "$torchtune" != 0 ] && extra_envs+=("torchtune --torchtune $venv_torchtune tests/torchtune")

# extra_job NAME FLAG VENV TESTS ARGS...: set up one extra environment (unless FLAG is "-"),
# then run its tests at nice 10; exit 3 when the set-up failed, else pytest's status (5,
# nothing selected, counts as 0).
extra_job() {
    local name="$1" flag="$2" env_dir="$3" tests="$4"
    shift 4
    if [ "$flag" != - ]; then
        echo "[test] $name: scripts/setup_env.sh $flag"
        bash scripts/setup_env.sh "$flag" || { echo "[test] $name: set-up failed"; return 3; }
    fi
    # a lower CPU priority for the tests and all they start: the foreground's many short tests
    # keep their core, and their progress lines keep coming
    renice -n 10 -p "$BASHPID" >/dev/null 2>&1 || true
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
    read -r name flag env_dir tests <<<"$entry"
    echo "[test] $name: tests in the background (log: $logs/$name.log)"
    extra_job "$name" "$flag" "$env_dir" "$tests" "$@" >"$logs/$name.log" 2>&1 &
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
