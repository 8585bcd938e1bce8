#!/usr/bin/env bash
# Train with torchtitan + muon_plugin, on torchtitan 0.2.2 (TOML) or 0.3 (Python configs).
#
#   scripts/train.sh CONFIG [torchtitan overrides ...]
#   scripts/train.sh configs/llama3_debug_muon.toml --training.steps 10 --optimizer.muon.ns_steps 7
#   scripts/train.sh configs/titan03_muon.py:llama3_debug_muon --optimizer.muon.ns_steps 7
#   scripts/train.sh muon_plugin.torchtitan03.configs:llama3.llama3_8b   # any shipped 0.3 config
#
# - CONFIG.toml: torchtitan 0.2.2 (./.venv); FILE.py:FUNCTION or MODULE:FUNCTION: torchtitan 0.3
#   (./.venv-titan03, scripts/setup_env_titan03.sh), through muon_plugin.torchtitan03.train;
# - runs from the repository root with .venv/bin/python, set up by scripts/setup_env.sh (instant
#   once done); PYTHON=/path/to/python uses your own environment instead, with no set-up;
# - builds the local corpus and tokenizer (scripts/prepare_data.py -> DATA_DIR, default data/)
#   when the job reads a path in it (e.g. --training.dataset_path data/corpus), a no-op once
#   built; with your own torch or torchtitan a build from other releases than the pinned ones
#   is a warning, and a DATA_DIR built by other releases is used as it is (one line says so);
# - NPROC processes: $NPROC if set, else one per GPU, else 2 on a CPU-only machine;
# - checks CONFIG and the overrides first, in one process (muon_plugin.torchtitan.check, or
#   muon_plugin.torchtitan03.check for 0.3): a typo or a bad value is one line naming the key,
#   before any worker starts;
# - torchrun --standalone --nproc_per_node $NPROC -m torchtitan.train --job.config_file CONFIG ...
#   (only local rank 0 prints; LOG_RANK=0,1 shows more);
# - logs to DUMP_FOLDER/logs/<date-time>/: train.log (what this prints) and ranks/ (every rank's
#   stdout and stderr, from torchrun --log-dir); the path is printed at start and end.
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="$1"
shift
# torchtitan 0.3: FILE.py:FUNCTION or MODULE:FUNCTION (a Python config function).
RELEASE=0.2.2
if [[ "$CONFIG" == *:* ]]; then
    RELEASE=0.3
    CONFIG_FN="${CONFIG##*:}"
    CONFIG="${CONFIG%:*}"
    CONFIG_MODULE="$CONFIG"
    if [[ -f "$CONFIG" ]]; then   # a file: its folder goes on PYTHONPATH, its name is the module
        CONFIG_DIR="$(cd "$(dirname "$CONFIG")" && pwd)"
        CONFIG_MODULE="$(basename "$CONFIG" .py)"
    elif [[ "$CONFIG" == *.py ]]; then
        echo "train.sh: config file not found: $CONFIG" >&2
        exit 2
    fi
# Resolve the config against the caller's directory before moving to the repository root.
elif [[ -f "$CONFIG" ]]; then
    CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
else
    echo "train.sh: config file not found: $CONFIG" >&2
    exit 2
fi
cd "$ROOT"

if [[ -n "${PYTHON:-}" ]]; then
    :   # an environment you manage yourself (e.g. a cluster image): used as is, no set-up
elif [[ "$RELEASE" == 0.3 ]]; then
    echo "[train] environment: scripts/setup_env.sh --titan03"
    bash scripts/setup_env.sh --titan03   # creates/refreshes .venv-titan03
    PYTHON="${MUON_PLUGIN_VENV_TITAN03:-$ROOT/.venv-titan03}/bin/python"
else
    echo "[train] environment: scripts/setup_env.sh"
    bash scripts/setup_env.sh   # creates/refreshes .venv; instant when nothing changed
    PYTHON="${MUON_PLUGIN_VENV:-$ROOT/.venv}/bin/python"
fi

export PYTHONPATH="$ROOT${CONFIG_DIR:+:$CONFIG_DIR}${PYTHONPATH:+:$PYTHONPATH}"
HELP=0
for arg in "$@"; do [[ "$arg" == "--help" || "$arg" == "-h" ]] && HELP=1; done
DUMP_FOLDER=""
READ_PATHS=()
if [[ "$HELP" == 0 ]]; then
    # One line naming the key and exit 2 on a bad config; prints the job's dump folder, then
    # the (absolute) paths the job reads, one per line.
    if [[ "$RELEASE" == 0.3 ]]; then
        CHECK=(-m muon_plugin.torchtitan03.check --module "$CONFIG_MODULE" --config "$CONFIG_FN")
    else
        CHECK=(-m muon_plugin.torchtitan.check "$CONFIG")
    fi
    CHECKED="$("$PYTHON" "${CHECK[@]}" "$@")" || exit 2
    DUMP_FOLDER="$(head -n 1 <<<"$CHECKED")"
    while IFS= read -r line; do
        [[ -n "$line" ]] && READ_PATHS+=("$line")
    done < <(tail -n +2 <<<"$CHECKED")
fi

# The run's log: DUMP_FOLDER/logs/<date-time>/train.log gets everything printed from here on.
LOG_DIR=""
RUN_LOG=/dev/null
if [[ -n "$DUMP_FOLDER" ]]; then
    LOG_DIR="$DUMP_FOLDER/logs/$(date +%Y%m%d-%H%M%S)"
    mkdir -p "$LOG_DIR"
    RUN_LOG="$LOG_DIR/train.log"
    export MUON_RUN_LOG="$RUN_LOG"   # the run summary names it
    echo "train.sh: log: $RUN_LOG (every rank: $LOG_DIR/ranks)"
fi
say() { echo "$*" | tee -a "$RUN_LOG"; }

# Local data, built only for a job that reads a path in DATA_DIR (a no-op once it is built).
DATA_DIR="${DATA_DIR:-data}"
READS_DATA=0
if [[ ${#READ_PATHS[@]} -gt 0 ]]; then   # the check printed realpaths: compare like with like
    DATA_REAL="$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.argv[1]))' "$DATA_DIR")"
    for path in "${READ_PATHS[@]}"; do
        [[ "$path" == "$DATA_REAL" || "$path" == "$DATA_REAL"/* ]] && READS_DATA=1
    done
fi
if [[ "$HELP" == 1 ]]; then
    :
elif [[ "$READS_DATA" == 0 ]]; then
    say "[train] data: the job reads nothing in $DATA_DIR, so scripts/prepare_data.py is not run"
elif [[ "${SKIP_PREPARE_DATA:-0}" == 1 ]]; then
    say "[train] data: $DATA_DIR as it is (SKIP_PREPARE_DATA=1, e.g. built on another machine)"
else
    say "[train] data: scripts/prepare_data.py --out $DATA_DIR"
    set +e
    "$PYTHON" scripts/prepare_data.py --out "$DATA_DIR" --quiet 2>&1 | tee -a "$RUN_LOG"
    PREPARED=${PIPESTATUS[0]}
    set -e
    if [[ "$PREPARED" != 0 ]]; then
        say "train.sh: scripts/prepare_data.py failed (exit $PREPARED); SKIP_PREPARE_DATA=1 uses $DATA_DIR as it is"
        exit "$PREPARED"
    fi
fi

if [[ -z "${NPROC:-}" ]]; then
    NGPU="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
    if [[ "$NGPU" -gt 0 ]]; then NPROC="$NGPU"; else NPROC=2; fi
fi

# Everything is local: never try to reach a model/dataset hub.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export PYTHONUNBUFFERED=1
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    # One share of the cores per process (torchrun would set 1 for several, nothing for one).
    CORES="$("$PYTHON" -c 'import os; print(len(os.sched_getaffinity(0)))' 2>/dev/null || echo 1)"
    export OMP_NUM_THREADS=$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))
fi

# LOG_RANK: which local ranks print (comma separated; default 0), as torchtitan's run_train.sh.
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC"
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3)
if [[ "$RELEASE" == 0.3 ]]; then
    TRAIN=(-m muon_plugin.torchtitan03.train --module "$CONFIG_MODULE" --config "$CONFIG_FN" "$@")
else
    TRAIN=(-m torchtitan.train --job.config_file "$CONFIG" "$@")
fi
say "[train] torchrun: $NPROC processes, ${TRAIN[*]}"
if [[ -z "$LOG_DIR" ]]; then
    exec "${TORCHRUN[@]}" "${TRAIN[@]}"
fi
set +e
"${TORCHRUN[@]}" --log-dir "$LOG_DIR/ranks" "${TRAIN[@]}" 2>&1 | tee -a "$RUN_LOG"
STATUS=${PIPESTATUS[0]}
set -e
echo "train.sh: log: $RUN_LOG (every rank: $LOG_DIR/ranks)"
exit "$STATUS"
