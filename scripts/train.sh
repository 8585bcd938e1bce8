#!/usr/bin/env bash
# Train with torchtitan + muon_plugin.
#
#   scripts/train.sh CONFIG [torchtitan overrides ...]
#   scripts/train.sh configs/llama3_debug_muon.toml --training.steps 10 --optimizer.muon.ns_steps 7
#
# - runs from the repository root with .venv/bin/python, set up by scripts/setup_env.sh (instant
#   once done); PYTHON=/path/to/python uses your own environment instead, with no set-up;
# - builds the local corpus and tokenizer (scripts/prepare_data.py -> data/) on first use;
# - NPROC processes: $NPROC if set, else one per GPU, else 2 on a CPU-only machine;
# - torchrun --standalone --nproc_per_node $NPROC -m torchtitan.train --job.config_file CONFIG ...
#   (only local rank 0 prints; LOG_RANK=0,1 shows more)
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="$1"
shift
# Resolve the config against the caller's directory before moving to the repository root.
if [[ -f "$CONFIG" ]]; then
    CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
else
    echo "train.sh: config file not found: $CONFIG" >&2
    exit 2
fi
cd "$ROOT"

if [[ -n "${PYTHON:-}" ]]; then
    :   # an environment you manage yourself (e.g. a cluster image): used as is, no set-up
else
    echo "[train] environment: scripts/setup_env.sh"
    bash scripts/setup_env.sh   # creates/refreshes .venv; instant when nothing changed
    PYTHON="${MUON_PLUGIN_VENV:-$ROOT/.venv}/bin/python"
fi

# Local data (idempotent: a no-op once data/ is up to date).
DATA_DIR="${DATA_DIR:-data}"
echo "[train] data: scripts/prepare_data.py --out $DATA_DIR"
"$PYTHON" scripts/prepare_data.py --out "$DATA_DIR" --quiet

if [[ -z "${NPROC:-}" ]]; then
    NGPU="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
    if [[ "$NGPU" -gt 0 ]]; then NPROC="$NGPU"; else NPROC=2; fi
fi

# Everything is local: never try to reach a model/dataset hub.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ "$NPROC" -gt 1 && -z "${OMP_NUM_THREADS:-}" ]]; then
    CORES="$("$PYTHON" -c 'import os; print(len(os.sched_getaffinity(0)))' 2>/dev/null || echo 1)"
    export OMP_NUM_THREADS=$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))
fi

# LOG_RANK: which local ranks print (comma separated; default 0), as torchtitan's run_train.sh.
echo "[train] torchrun: $NPROC processes, torchtitan.train --job.config_file $CONFIG $*"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
    -m torchtitan.train --job.config_file "$CONFIG" "$@"
