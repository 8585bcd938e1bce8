#!/usr/bin/env bash
# Create ./.venv with everything the tests, benchmarks and the torchtitan demo need.
# Idempotent: a re-run only checks a stamp, unless pyproject.toml or this script changed.
#
# torch: ./.venv pins torch 2.13.0; ./.venv-titan03 pins 2.14.1 (torchtitan 0.3 is released
# against torch 2.14: its pipeline schedules call 2.14's API); ./.venv-torchtune pins 2.13.0
# (torchtune 0.6.1 with torchao 0.15: torchtune does not import with ./.venv's torchao 0.18).
# ./.venv-torchtune shares ./.venv's packages when ./.venv holds the same torch: a .pth file
# puts ./.venv's site-packages after its own, so it installs only what differs (torchtune,
# torchao 0.15, ...: about 0.1 GB instead of a second torch).
# On a machine without an NVIDIA GPU, the CPU build torch==<pin>+cpu from PyTorch's CPU wheel
# index when that index answers within $MUON_PLUGIN_INDEX_TIMEOUT s (default 5); else
# torch==<pin> from PyPI, which on Linux is the CUDA build (a one-line note gives its download
# size first). With a GPU: a system torch if there is one, else torch>=2.11 (>=2.14 for
# torchtitan 0.3) from PyPI.
#
# Environment: MUON_PLUGIN_VENV (default ./.venv), MUON_PLUGIN_VENV_TITAN03 (./.venv-titan03),
# MUON_PLUGIN_VENV_TORCHTUNE (./.venv-torchtune), BASE_PYTHON (default python3, >= 3.11),
# MUON_PLUGIN_TORCH_INDEX (default https://download.pytorch.org/whl/cpu).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base_python="${BASE_PYTHON:-python3}"
torch_pin="2.13.0"   # ./.venv and --torchtune; --titan03 sets 2.14.1
torch_min="2.11"
cpu_index="${MUON_PLUGIN_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
index_timeout="${MUON_PLUGIN_INDEX_TIMEOUT:-5}"

say() { echo "[setup_env] $*"; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# index_answers URL: whether the simple index at URL lists torch within $index_timeout seconds.
index_answers() {
    "$base_python" - "$1/torch/" "$index_timeout" <<'EOF' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
}

# install_torch VENV: torch as described at the top of this file.
install_torch() {
    local py="$1/bin/python"
    local pip=("$py" -m pip install --disable-pip-version-check --no-compile)
    if has_gpu; then
        say "torch: NVIDIA GPU found; installing torch>=$torch_min from PyPI (CUDA build)"
        "${pip[@]}" "torch>=$torch_min"
        return
    fi
    say "torch: no NVIDIA GPU; asking PyTorch's CPU wheel index ($cpu_index, ${index_timeout} s timeout)"
    if index_answers "$cpu_index"; then
        say "torch: installing the CPU build torch==$torch_pin+cpu from $cpu_index"
        "${pip[@]}" --extra-index-url "$cpu_index" "torch==$torch_pin+cpu"
        return
    fi
    say "torch: $cpu_index did not answer; asking pip what torch==$torch_pin from PyPI would download"
    local report
    report="$(mktemp)"
    local size="download size unknown"
    if "${pip[@]}" --quiet --dry-run --ignore-installed --report "$report" "torch==$torch_pin" \
        >/dev/null 2>&1; then
        size="$("$py" "$root/scripts/download_size.py" "$report" 2>/dev/null || echo "$size")"
    fi
    rm -f "$report"
    say "torch: installing torch==$torch_pin from PyPI: $size"
    "${pip[@]}" "torch==$torch_pin"
}

# setup_venv VENV WHAT PIP_ARGS...: create VENV (if needed), install torch, then `pip install
# PIP_ARGS...` (WHAT says what that is); skipped when VENV's stamp matches this script,
# pyproject.toml and PIP_ARGS.
setup_venv() {
    local venv="$1" what="$2"
    shift 2
    local stamp="$venv/.muon_plugin_setup"
    local want
    want="$( (cat "$root/pyproject.toml" "$root/scripts/setup_env.sh"; echo "$*") | sha256sum | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(not (
            u.find_spec('torch') and u.find_spec('muon_plugin')))" 2>/dev/null; then
        say "$venv is up to date"
        return
    fi
    local start=$SECONDS
    local shared="${SHARE_FROM:-}"
    if [ ! -x "$venv/bin/python" ]; then
        if ! "$base_python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "[setup_env] $base_python is not Python >= 3.11; set BASE_PYTHON" >&2
            exit 1
        fi
        if has_gpu && "$base_python" -c "import torch" 2>/dev/null; then
            say "creating $venv (sharing the system's torch)"
            "$base_python" -m venv --system-site-packages "$venv"
        else
            say "creating $venv ($("$base_python" --version))"
            "$base_python" -m venv "$venv"
        fi
        if [ -n "$shared" ]; then
            local site
            site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
            echo "$shared" >"$site/_muon_plugin_shared.pth"
            say "sharing $(dirname "$(dirname "$(dirname "$shared")")")'s packages (torch included) through $site/_muon_plugin_shared.pth"
        fi
    fi
    local have
    have="$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
    if [ -n "$have" ] && { has_gpu || [ "${have%%+*}" = "$torch_pin" ]; }; then
        say "torch: $have already installed"
    else
        [ -n "$have" ] && say "torch: $have installed, this environment pins $torch_pin"
        install_torch "$venv"
    fi
    say "installing $what (pip install $*)"
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-compile "$@"
    # pip's byte-compilation of every installed module is skipped (--no-compile): for ./.venv
    # it took 69 of the 123 core-seconds of the set-up on 2 cores. The modules a training run
    # and the tests import get their bytecode here instead (about 16 core-s for ./.venv), and
    # any other module when a process first imports it (where PYTHONDONTWRITEBYTECODE allows).
    say "bytecode of the modules runs import: python -c 'import ${WARM_IMPORTS// /, }'"
    (unset PYTHONDONTWRITEBYTECODE; PYTHONWARNINGS=ignore "$venv/bin/python" -c "import ${WARM_IMPORTS// /, }")
    echo "$want" >"$stamp"
    say "done in $((SECONDS - start)) s: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
}

# extra_list EXTRA: the requirements of pyproject.toml's extra EXTRA, for the progress line.
extra_list() {
    "$base_python" -c 'import sys, tomllib
print(", ".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"][sys.argv[2]]))' \
        "$root/pyproject.toml" "$1" 2>/dev/null || echo "see pyproject.toml"
}

# One environment per call: ./.venv (default: torchtitan 0.2.2 and everything the tests need),
# --titan03 ./.venv-titan03 (torchtitan 0.3.0 and its tests), --torchtune ./.venv-torchtune
# (torchtune 0.6.1 and its tests).
case "${1:-}" in
    "")
        WARM_IMPORTS="torch torchtitan.train muon_plugin.torchtitan pytest"
        setup_venv "${MUON_PLUGIN_VENV:-$root/.venv}" \
            "muon_plugin (editable) and its dev extra: $(extra_list dev)" -e "$root[dev]" ;;
    --titan03)
        torch_pin="2.14.1"
        torch_min="2.14"
        WARM_IMPORTS="torch torchtitan.train muon_plugin.torchtitan03 pytest"
        setup_venv "${MUON_PLUGIN_VENV_TITAN03:-$root/.venv-titan03}" \
            "muon_plugin (editable) with torchtitan 0.3: $(extra_list torchtitan03)" \
            -e "$root[torchtitan03]" ;;
    --torchtune)
        main_venv="${MUON_PLUGIN_VENV:-$root/.venv}"
        SHARE_FROM="$("$main_venv/bin/python" -c "import sysconfig, torch
if torch.__version__.split('+')[0] == '$torch_pin':
    print(sysconfig.get_paths()['purelib'])" 2>/dev/null || true)"
        WARM_IMPORTS="torch torchtune.training torchao muon_plugin.torchtune pytest"
        setup_venv "${MUON_PLUGIN_VENV_TORCHTUNE:-$root/.venv-torchtune}" \
            "muon_plugin (editable) with torchtune 0.6.1: $(extra_list torchtune)" \
            -e "$root[torchtune]" ;;
    *)
        echo "[setup_env] unknown option $1 (expected none, --titan03 or --torchtune)" >&2
        exit 2 ;;
esac
