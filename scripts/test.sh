#!/usr/bin/env bash
# The project's test command: set up ./.venv (torchtitan 0.2.2, scripts/setup_env.sh),
# ./.venv-titan03 (torchtitan 0.3, scripts/setup_env.sh --titan03) and ./.venv-torchtune
# (torchtune 0.6.1, scripts/setup_env.sh --torchtune), then run pytest in each: everything in
# ./.venv (tests/titan03 and tests/torchtune are skipped there), tests/titan03 in
# ./.venv-titan03, tests/torchtune in ./.venv-torchtune.
#
# ./.venv is set up first, in the foreground; the two others are set up in the background while
# its tests run (their downloads overlap the tests), each logging to .test-logs/setup_<env>.log,
# whose steps are printed when that environment's tests start.
# Extra arguments go to every pytest run, e.g. `bash scripts/test.sh -k distributed`.
# MUON_PLUGIN_TITAN03=0 skips the torchtitan 0.3 environment, MUON_PLUGIN_TORCHTUNE=0 the
# torchtune one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
echo "[test] environment: scripts/setup_env.sh"
bash scripts/setup_env.sh
venv="${MUON_PLUGIN_VENV:-$root/.venv}"
logs="$root/.test-logs"
mkdir -p "$logs"

# "NAME FLAG VENV TESTS": an extra environment, its set-up flag, its folder and its tests.
extra_envs=()
[ "${MUON_PLUGIN_TITAN03:-1}" != 0 ] \
    && extra_envs+=("titan03 --titan03 ${MUON_PLUGIN_VENV_TITAN03:-$root/.venv-titan03} tests/titan03")
[ "${MUON_PLUGIN_TORCHTUNE:-1}" != 0 ] \
    && extra_envs+=("torchtune --torchtune ${MUON_PLUGIN_VENV_TORCHTUNE:-$root/.venv-torchtune} tests/torchtune")

declare -A setup_pid=()
for entry in "${extra_envs[@]}"; do
    read -r name flag _ _ <<<"$entry"
    echo "[test] environment: scripts/setup_env.sh $flag, in the background (log: $logs/setup_$name.log)"
    bash scripts/setup_env.sh "$flag" >"$logs/setup_$name.log" 2>&1 &
    setup_pid[$name]=$!
done

status=0
echo "[test] $venv/bin/python -m pytest $*"
"$venv/bin/python" -m pytest "$@" || status=$?

for entry in "${extra_envs[@]}"; do
    read -r name flag env_dir tests <<<"$entry"
    setup_rc=0
    wait "${setup_pid[$name]}" || setup_rc=$?
    grep '^\[setup_env\]' "$logs/setup_$name.log" || true
    if [ "$setup_rc" != 0 ]; then
        echo "[test] scripts/setup_env.sh $flag failed (exit $setup_rc); the end of its log:"
        tail -40 "$logs/setup_$name.log"
        status=$setup_rc
        continue
    fi
    echo "[test] $name: $env_dir/bin/python -m pytest $tests $*"
    MUON_PLUGIN_PYTHON_022="$venv/bin/python" "$env_dir/bin/python" -m pytest "$tests" "$@" \
        || { rc=$?; [ "$rc" = 5 ] || status=$rc; }   # 5: nothing selected (e.g. by -k)
done
exit "$status"
