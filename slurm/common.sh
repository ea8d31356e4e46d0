# Sourced by slurm/*.sbatch: environment, `phase NAME` logging with timestamps, fail-fast traps, `dapo_launch`.
#
# sbatch copies the job script to a spool directory, so the scripts find this file (and the repository) through
# $DAPO_ROOT, default: the directory sbatch was called from. Submit from the repository root, or export DAPO_ROOT.
# Optional environment: PYTHON (default: $DAPO_ROOT/.venv/bin/python if present, else python3), DAPO_ENV_SETUP (a
# file sourced first, e.g. `module load ...` or a conda activate), OMP_NUM_THREADS.

set -Eeuo pipefail

DAPO_ROOT=${DAPO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$DAPO_ROOT"
if [[ -n ${DAPO_ENV_SETUP:-} ]]; then
    # shellcheck disable=SC1090
    source "$DAPO_ENV_SETUP"
fi
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $DAPO_ROOT/.venv/bin/python ]]; then PYTHON=$DAPO_ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
export DAPO_ROOT PYTHON
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # compute nodes usually have no internet: read checkpoints from disk

_DAPO_T0=$(date +%s)
_DAPO_PHASE=setup

# phase NAME: mark the start of a phase (timestamp, seconds since the job started); errors name the phase.
phase() {
    _DAPO_PHASE=$1
    printf '[%s +%ds] == %s\n' "$(date '+%F %T')" $(($(date +%s) - _DAPO_T0)) "$1" >&2
}

_dapo_on_error() {
    local rc=$? line=$1 cmd=$2
    printf '[%s +%ds] FAILED in phase %s (line %s, exit %d): %s\n' "$(date '+%F %T')" \
        $(($(date +%s) - _DAPO_T0)) "$_DAPO_PHASE" "$line" "$rc" "$cmd" >&2
    exit "$rc"
}
_dapo_on_exit() {
    local rc=$?
    printf '[%s +%ds] job %s ended with exit code %d (phase %s)\n' "$(date '+%F %T')" \
        $(($(date +%s) - _DAPO_T0)) "${SLURM_JOB_ID:-?}" "$rc" "$_DAPO_PHASE" >&2
}
trap '_dapo_on_error $LINENO "$BASH_COMMAND"' ERR
trap _dapo_on_exit EXIT

# dapo_launch ARGS...: the in-allocation driver (= `dapo launch`): SGLang servers, trainer step, fail fast.
dapo_launch() {
    "$PYTHON" -m megatron_dapo.launch.slurm "$@"
}

phase "job ${SLURM_JOB_ID:-(no Slurm job)}: ${SLURM_JOB_NUM_NODES:-?} nodes (${SLURM_JOB_NODELIST:-?}),\
 GPUs/node ${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}, python $PYTHON, repo $DAPO_ROOT"
