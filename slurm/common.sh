# Sourced by slurm/*.sbatch: environment, `phase NAME` logging with timestamps, fail-fast traps, `dapo_launch`, and the
# time-limit protocol: the scripts ask Slurm for SIGUSR1 on this shell T seconds before the limit
# (#SBATCH --signal=B:USR1@T, T >= one DAPO step + one checkpoint save). The trap below leaves a file the driver
# watches ($DAPO_SIGNAL_FILE); the trainer saves after its current step, the driver exits 75, and dapo_launch requeues
# the job (same id and options; the next allocation resumes from the checkpoint with --resume auto). DAPO_REQUEUE=0:
# exit 75 instead, for a wrapper that resubmits.
#
# sbatch copies the job script to a spool directory, so the scripts find this file (and the repository) not through
# $0 but by the lines they open with (the same in every slurm/*.sbatch): $DAPO_ROOT if set, else the path the script
# was submitted as (scontrol's Command=), else the directory sbatch was called from; none has slurm/common.sh: one
# line naming DAPO_ROOT, exit 2. Submit from anywhere; a copy of a script outside the repository needs DAPO_ROOT.
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
# the signal came while the script looked for this file (its first lines keep it in _DAPO_EARLY_USR1)
if [[ -n ${_DAPO_EARLY_USR1:-} ]]; then _dapo_on_usr1; fi

DAPO_ROOT=${DAPO_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$DAPO_ROOT"
DAPO_ROOT=$PWD # absolute, without the scripts' slurm/.. (the steps' containers mount it at this path)
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
# CPU-only torch in $PYTHON (the default, the repository's .venv, is one) before any step starts; skipped for
# --dry-run (it starts nothing). With CONTAINER_IMAGE the steps run the image's python, and this checks the driver's:
# the driver runs on the batch node's host, not in the image, because it starts the steps with srun and reads
# scontrol, which a pyxis image lacks (launch/nemo.py runs it so too); a CPU torch is enough for it. Its first act
# is then the GPU stack's preflight inside the image, one task on this node, before any server step
# (megatron_dapo/launch/preflight.py: CUDA torch, the GPUs, TE, SGLang, megatron-core).
dapo_require_gpu_python() {
    local arg line last='' cuda='' rc=0 out=$DAPO_SIGNAL_FILE.torch
    for arg in "$@"; do [[ $arg != --dry-run ]] || return 0; done
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        "$PYTHON" -c 'import megatron_dapo.launch.slurm' >"$out" 2>&1 || rc=$?
        while IFS= read -r line || [[ -n $line ]]; do last=$line; done <"$out" # the last line: the error
        rm -f "$out"
        if ((rc != 0)); then
            printf '%s %s %s\n' "the driver runs on the batch node outside CONTAINER_IMAGE (it starts the steps with srun)," \
                "but PYTHON=$PYTHON cannot import megatron_dapo.launch.slurm ($last): set PYTHON to a python with this" \
                "package's requirements ($DAPO_ROOT/.venv from \`make .venv/.installed\`; a CPU torch is enough)" >&2
            return 3
        fi
        return 0
    fi
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

# dapo_check_inputs KIND:VAR...: the job's inputs, checked on the batch node before any step starts (a missing parquet
# found after 32 servers loaded the model costs an hour). One line per problem, each naming the variable and its value,
# all of them, then return 2. KIND: model (an HF checkpoint directory: config.json and *.safetensors), files
# (comma-separated readable files), outdir (a writable directory, or one that can be created), image (CONTAINER_IMAGE:
# a local path must be a file; registry#image:tag is pyxis's to fetch), ifname (comma-separated network interfaces of
# this node: NCCL's and gloo's sockets; empty: their own choice, said once). With CONTAINER_IMAGE the paths must also
# be where the steps' containers see them: under DAPO_ROOT or a CONTAINER_MOUNTS entry mounted at its own path.
dapo_check_inputs() {
    local spec kind var value item items found path mount mounts src dst seen dir weights nets='' problems=()
    for spec in "$@"; do
        kind=${spec%%:*} var=${spec#*:}
        value=${!var:-}
        if [[ -z $value ]]; then
            case $kind in
            image) ;;
            ifname) _dapo_log '%s' "$var is empty: NCCL picks its sockets' interface itself, gloo (the control plane) \
the one $HOSTNAME resolves to; set $var=<interface> (e.g. ib0) if that is not the nodes' network" ;;
            *) problems+=("$var is empty") ;;
            esac
            continue
        fi
        IFS=, read -r -a items <<<"$value"
        for item in "${items[@]}"; do
            found=${#problems[@]}
            case $kind in
            model)
                weights=("$item"/*.safetensors)
                if [[ ! -d $item ]]; then
                    problems+=("$var=$item: no such directory")
                elif [[ ! -f $item/config.json ]]; then
                    problems+=("$var=$item: no config.json (not a Hugging Face checkpoint directory)")
                elif [[ ! -f ${weights[0]} ]]; then
                    problems+=("$var=$item: no *.safetensors (not a Hugging Face checkpoint directory)")
                fi
                ;;
            files)
                if [[ ! -e $item ]]; then
                    problems+=("$var=$item: no such file")
                elif [[ ! -f $item || ! -r $item ]]; then
                    problems+=("$var=$item: not a readable file")
                fi
                ;;
            outdir)
                dir=$item
                while [[ ! -e $dir ]]; do # the nearest existing parent (/ and . exist)
                    case $dir in
                    */*) dir=${dir%/*} dir=${dir:-/} ;;
                    *) dir=. ;;
                    esac
                done
                if [[ $dir == "$item" && (! -d $dir || ! -w $dir) ]]; then
                    problems+=("$var=$item: not a writable directory")
                elif [[ ! -d $dir || ! -w $dir ]]; then
                    problems+=("$var=$item: cannot be created ($dir is not a writable directory)")
                fi
                ;;
            image)
                if [[ $item != *'#'* && ($item == /* || $item == .* || $item == *.sqsh) && ! -f $item ]]; then
                    problems+=("$var=$item: no such file (a squashfs image: enroot import -o $item ...)")
                fi
                ;;
            ifname)
                item=${item#=} # NCCL's "exact name" mark; gloo takes names as they are
                if [[ ! -e /sys/class/net/$item ]]; then
                    if [[ -z $nets ]]; then
                        for path in /sys/class/net/*; do nets+=" ${path##*/}"; done
                    fi
                    problems+=("$var=$item: no such network interface on $HOSTNAME (it has:$nets)")
                fi
                ;;
            esac
            if [[ -n ${CONTAINER_IMAGE:-} && $kind =~ ^(model|files|outdir)$ ]] && ((found == ${#problems[@]})); then
                path=$item seen=''
                [[ $path == /* ]] || path=$PWD/$path
                IFS=, read -r -a mounts <<<"$DAPO_ROOT,${CONTAINER_MOUNTS:-}" # SRC[:DST[:FLAGS]]
                for mount in "${mounts[@]}"; do
                    src=${mount%%:*} dst=${mount#*:}
                    dst=${dst%%:*}
                    [[ -n $src && $src == "$dst" && ($path == "$src" || $path == "${src%/}"/*) ]] && seen=1
                done
                [[ -n $seen ]] || problems+=("$var=$item: not under DAPO_ROOT or a CONTAINER_MOUNTS entry mounted at \
its own path (CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-}): the steps in CONTAINER_IMAGE would not see it")
            fi
        done
    done
    if ((${#problems[@]})); then
        printf '%s\n' "${problems[@]}" >&2
        _dapo_log '%d problem(s) with the inputs above: nothing was started' "${#problems[@]}"
        return 2
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

# the account and partition the job got (sbatch -A/-p, SBATCH_ACCOUNT/SBATCH_PARTITION or the cluster's defaults)
phase "job ${SLURM_JOB_ID:-(no Slurm job)}: ${SLURM_JOB_NUM_NODES:-?} nodes (${SLURM_JOB_NODELIST:-?}),\
 GPUs/node ${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}, account ${SLURM_JOB_ACCOUNT:-?}, partition\
 ${SLURM_JOB_PARTITION:-?}, python $PYTHON, repo $DAPO_ROOT"
