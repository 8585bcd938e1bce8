#!/usr/bin/env bash
# Create ./.venv-titan03: muon_plugin with torchtitan 0.3.0 (the second release the plugin
# supports; ./.venv holds torchtitan 0.2.2). Idempotent: instant unless pyproject.toml or this
# script changed. MUON_PLUGIN_VENV_TITAN03 chooses another folder.
# Without an NVIDIA GPU it installs torch 2.13.0's CPU build (about 190 MB; torch 2.14+ on PyPI
# are CUDA builds of several GB, and torchtitan 0.3 declares no torch requirement).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MUON_PLUGIN_VENV_TITAN03:-$root/.venv-titan03}"
python="${BASE_PYTHON:-python3}"
stamp="$venv/.muon_plugin_setup"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup_env_titan03.sh" | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && "$venv/bin/python" -c "import torch, torchtitan.config.override, muon_plugin" 2>/dev/null; then
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
    if [ "$has_gpu" = 1 ]; then
        "${pip[@]}" "torch>=2.11"
    else
        "${pip[@]}" "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
fi
"${pip[@]}" -e "$root[torchtitan03]"
echo "$want" >"$stamp"
echo "setup_env_titan03: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') + torchtitan 0.3.0 in $venv"
