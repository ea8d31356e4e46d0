# Sourced by slurm/*.sbatch: environment, `phase NAME` logging with timestamps, fail-fast traps, `dapo_launch`, and the
# time-limit protocol: the scripts ask Slurm for SIGUSR1 on this shell T seconds before the limit
# (#SBATCH --signal=B:USR1@T, T >= one DAPO step + one checkpoint save). The trap below leaves a file the driver
# watches ($DAPO_SIGNAL_FILE); the trainer saves after its current step, the driver exits 75, and dapo_launch requeues
# the job (same id and options; the next allocation resumes from the checkpoint with --resume auto). DAPO_REQUEUE=0:
# exit 75 instead, for a wrapper that resubmits.
#
# sbatch copies the job script to a spool directory, so the scripts find this file (and the repository) through
# $DAPO_ROOT, default: the directory sbatch was called from. Submit from the repository root, or export DAPO_ROOT.
# Optional environment: PYTHON (default: $DAPO_ROOT/.venv/bin/python if present, else python3; the GPU scripts refuse
# a CPU-only torch: dapo_require_gpu_python), DAPO_ENV_SETUP (a file sourced first, e.g. `module load ...` or a conda
# activate), OMP_NUM_THREADS.

set -Eeuo pipefail

# The traps first, and no command substitution ($(...)) in this file, only builtins: bash 5.2 (5.2.15 measured)
# fails a $(...) being parsed when a trapped signal arrives ("trap: line 2: unexpected EOF while looking for matching
# `)'", exit 2 under set -e), and Slurm's SIGUSR1 may come at any moment, in a requeued allocation as it starts.
# _dapo_log FORMAT ARGS...: one stderr line prefixed with the time and the seconds since the job started.
_dapo_log() { # no locals: the USR1 trap may run inside it, and bash 5.2 then mixes up function contexts
    printf -v _DAPO_NOW '%(%s)T' -1
    printf "[%(%F %T)T +%ds] $1\n" -1 $((_DAPO_NOW - _DAPO_T0)) "${@:2}" >&2
}
printf -v _DAPO_T0 '%(%s)T' -1
_DAPO_PHASE=setup

# phase NAME: mark the start of a phase (timestamp, seconds since the job started); errors name the phase.
phase() {
    _DAPO_PHASE=$1
    _dapo_log '== %s' "$1"
}

_dapo_on_error() {
    local rc=$? line=$1 cmd=$2
    _dapo_log 'FAILED in phase %s (line %s, exit %d): %s' "$_DAPO_PHASE" "$line" "$rc" "$cmd"
    exit "$rc"
}
_dapo_on_exit() {
    local rc=$?
    rm -f "$DAPO_SIGNAL_FILE"
    _dapo_log 'job %s ended with exit code %d (phase %s)' "${SLURM_JOB_ID:-?}" "$rc" "$_DAPO_PHASE"
}
DAPO_SIGNAL_FILE=${TMPDIR:-/tmp}/dapo-signal-${SLURM_JOB_ID:-0}-$$-$RANDOM
export DAPO_SIGNAL_FILE
_dapo_on_usr1() {
    : >"$DAPO_SIGNAL_FILE"
    _dapo_log 'SIGUSR1 (time limit near): the trainer saves after its current step'
}
trap '_dapo_on_error $LINENO "$BASH_COMMAND"' ERR
trap _dapo_on_exit EXIT
trap _dapo_on_usr1 USR1

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

# dapo_require_gpu_python ARGS...: a job that asks for CUDA devices and SGLang (the GPU scripts call this) refuses a
# CPU-only torch in $PYTHON (the default, the repository's .venv, is one) before any step starts. Skipped when the
# steps run a container's python (CONTAINER_IMAGE) and for --dry-run (it starts nothing). `dapo launch` then checks
# the rest of the stack (megatron_dapo/launch/preflight.py).
dapo_require_gpu_python() {
    local arg line cuda='' rc=0 out=$DAPO_SIGNAL_FILE.torch
    [[ -z ${CONTAINER_IMAGE:-} ]] || return 0
    for arg in "$@"; do [[ $arg != --dry-run ]] || return 0; done
    local fix="set PYTHON=/path/to/gpu-venv/bin/python (CUDA torch, SGLang, Transformer Engine: requirements/gpu.txt)"
    fix+=" or CONTAINER_IMAGE=<an image built from docker/Dockerfile> (the steps then run its python)"
    "$PYTHON" -c 'import torch; print(torch.version.cuda or "")' >"$out" 2>&1 || rc=$?
    while IFS= read -r line || [[ -n $line ]]; do cuda=$line; done <"$out" # the last line
    rm -f "$out"
    if ((rc != 0)); then
        printf 'this job needs CUDA devices and SGLang, but PYTHON=%s cannot import torch (%s): %s\n' \
            "$PYTHON" "$cuda" "$fix" >&2
        return 3
    fi
    if [[ -z $cuda ]]; then
        printf 'this job needs CUDA devices and SGLang, but PYTHON=%s has a CPU-only torch: %s\n' "$PYTHON" "$fix" >&2
        return 3
    fi
}

# dapo_launch ARGS...: the in-allocation driver (= `dapo launch`): SGLang servers, trainer step, fail fast. It runs in
# the background because bash runs a trap only once the foreground command has ended; exit 75 (stopped early, saved)
# requeues the job.
dapo_launch() {
    local pid rc again
    # DAPO_STOP_BEFORE (seconds, below the --signal margin): the driver also stops the trainer by the job's end time
    # (scontrol), should the signal not come: Slurm sends it once per allocation at best, from a periodic check
    "$PYTHON" -m megatron_dapo.launch.slurm ${DAPO_STOP_BEFORE:+--stop-before "$DAPO_STOP_BEFORE"} "$@" &
    pid=$!
    while :; do
        rc=0
        wait "$pid" || rc=$?
        ((rc > 128)) || break
        kill -0 "$pid" 2>/dev/null && continue # the USR1 trap interrupted wait; the driver runs on
        again=0
        wait "$pid" 2>/dev/null || again=$? # the driver ended as the trap ran: its own status, if bash kept it
        ((again == 127)) || rc=$again
        break
    done
    if ((rc == 75)) && [[ ${DAPO_REQUEUE:-1} == 1 && -n ${SLURM_JOB_ID:-} ]]; then
        phase "requeue: job $SLURM_JOB_ID stopped before its time limit after saving; it resumes from the checkpoint"
        if scontrol requeue "$SLURM_JOB_ID"; then
            sleep 600 & # Slurm ends this allocation now; wait for it
            wait $! || true
        fi
        printf 'scontrol requeue %s failed: resubmit the job; it resumes from its checkpoint\n' "$SLURM_JOB_ID" >&2
    fi
    return "$rc"
}

phase "job ${SLURM_JOB_ID:-(no Slurm job)}: ${SLURM_JOB_NUM_NODES:-?} nodes (${SLURM_JOB_NODELIST:-?}),\
 GPUs/node ${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}, python $PYTHON, repo $DAPO_ROOT"
