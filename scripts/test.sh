#!/usr/bin/env bash
# The project's test command: set up ./.venv (scripts/setup_env.sh), then run pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k distributed`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
echo "[test] environment: scripts/setup_env.sh"
bash "$root/scripts/setup_env.sh"
cd "$root"
python="${MUON_PLUGIN_VENV:-$root/.venv}/bin/python"
echo "[test] $python -m pytest $*"
exec "$python" -m pytest "$@"
