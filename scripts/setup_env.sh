#!/usr/bin/env bash
# Create ./.venv with everything the tests, benchmarks and the torchtitan demo need.
# Idempotent: re-runs are instant unless pyproject.toml changed. Needs only PyPI.
# On a machine without an NVIDIA GPU it pins the CPU build of torch (torch==2.13.0) so that
# pip never pulls a multi-GB CUDA build; with a GPU it reuses a system torch if one exists.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MUON_PLUGIN_VENV:-$root/.venv}"
python="${BASE_PYTHON:-python3}"
# `setup_env.sh --titan03`: the second environment, torchtitan 0.3 (./.venv-titan03).
if [ "${1:-}" = "--titan03" ]; then exec bash "$root/scripts/setup_env_titan03.sh"; fi
stamp="$venv/.muon_plugin_setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import torch, muon_plugin" 2>/dev/null; then
    exit 0
fi

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

if [ ! -x "$venv/bin/python" ]; then
    if [ "$has_gpu" = 1 ] && "$python" -c "import torch" 2>/dev/null; then
        "$python" -m venv --system-site-packages "$venv"   # keep the machine's CUDA torch
    else
        "$python" -m venv "$venv"
    fi
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if [ "$has_gpu" = 1 ]; then "${pip[@]}" "torch>=2.11"; else "${pip[@]}" "torch==2.13.0"; fi
fi
"${pip[@]}" -e "$root[dev]"
echo "$want" >"$stamp"
echo "setup_env: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') in $venv"
