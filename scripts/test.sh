#!/usr/bin/env bash
# The project's test command: set up ./.venv (torchtitan 0.2.2, scripts/setup_env.sh) and
# ./.venv-titan03 (torchtitan 0.3, scripts/setup_env_titan03.sh), then run pytest in each:
# everything in ./.venv (tests/titan03 is skipped there), tests/titan03 in ./.venv-titan03.
# Extra arguments go to both pytest runs, e.g. `bash scripts/test.sh -k distributed`.
# MUON_PLUGIN_TITAN03=0 skips the torchtitan 0.3 environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
echo "[test] environment: scripts/setup_env.sh"
bash "$root/scripts/setup_env.sh"
cd "$root"
venv="${MUON_PLUGIN_VENV:-$root/.venv}"
status=0
echo "[test] $venv/bin/python -m pytest $*"
"$venv/bin/python" -m pytest "$@" || status=$?
if [ "${MUON_PLUGIN_TITAN03:-1}" != 0 ]; then
    echo "[test] environment: scripts/setup_env_titan03.sh"
    bash "$root/scripts/setup_env_titan03.sh"
    echo "[test] torchtitan 0.3: pytest tests/titan03 $*"
    venv03="${MUON_PLUGIN_VENV_TITAN03:-$root/.venv-titan03}"
    MUON_PLUGIN_PYTHON_022="$venv/bin/python" "$venv03/bin/python" -m pytest tests/titan03 "$@" \
        || { rc=$?; [ "$rc" = 5 ] || status=$rc; }   # 5: nothing selected (e.g. by -k)
fi
exit "$status"
