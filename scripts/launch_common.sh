# shellcheck shell=bash disable=SC2034
# Sourced by launch_single_node.sh and launch_multi_node.sh, never run: their shared option
# parsing, the CPU mode and the assembly and printing of the torchrun command, so that both
# launchers accept the same options and a dry run prints exactly what a real run executes.
# (SC2034 is off: the variables set here are read by the launchers that source this file.)

# Options shared by both launchers (filled in by launch_parse_args).
cpu_mode=0
dry_run=0
nproc=""
nnodes=""
node_rank=""
script=""
module=""
passthrough=()

launch_die() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}

launch_need_value() {
    # $1: option name, $2: number of arguments left including the option itself.
    [[ $2 -ge 2 ]] || launch_die "$1 needs a value"
}

launch_check_count() {
    # $1: option name, $2: value, $3: smallest allowed value.
    [[ $2 =~ ^[0-9]+$ ]] || launch_die "$1 must be a whole number, got '$2'"
    ((10#$2 >= $3)) || launch_die "$1 must be at least $3, got '$2'"
}

# Parse the command line. $1 is 1 for the multi-node launcher (which accepts --nnodes and
# --node-rank), 0 otherwise; the rest is the user's command line. Options of the launcher may
# appear anywhere; everything else (Megatron and --omnibal* flags) passes through in order, and
# everything after `--` passes through unread.
launch_parse_args() {
    local multi=$1
    shift
    while (($#)); do
        case "$1" in
            --cpu) cpu_mode=1 ;;
            --dry-run) dry_run=1 ;;
            --nproc-per-node)
                launch_need_value "$1" $#
                nproc=$2
                shift
                ;;
            --nproc-per-node=*) nproc=${1#*=} ;;
            --script)
                launch_need_value "$1" $#
                script=$2
                shift
                ;;
            --script=*) script=${1#*=} ;;
            --module)
                launch_need_value "$1" $#
                module=$2
                shift
                ;;
            --module=*) module=${1#*=} ;;
            --nnodes | --node-rank | --nnodes=* | --node-rank=*)
                ((multi)) || launch_die "$1 is for several nodes: use launch_multi_node.sh"
                local name=${1%%=*} value
                if [[ $1 == *=* ]]; then
                    value=${1#*=}
                else
                    launch_need_value "$1" $#
                    value=$2
                    shift
                fi
                if [[ $name == --nnodes ]]; then nnodes=$value; else node_rank=$value; fi
                ;;
            -h | --help)
                launch_usage
                exit 0
                ;;
            --)
                shift
                passthrough+=("$@")
                break
                ;;
            *) passthrough+=("$1") ;;
        esac
        shift
    done
}

# Number of processes on this node: --nproc-per-node, else GPUS_PER_NODE, else one per GPU
# (torchrun counts them) or, with --cpu, 2 (the smallest pipeline).
launch_resolve_nproc() {
    if [[ -z $nproc ]]; then
        if [[ -n ${GPUS_PER_NODE:-} ]]; then
            nproc=$GPUS_PER_NODE
        elif ((cpu_mode)); then
            nproc=2
        else
            nproc=gpu
        fi
    fi
    [[ $nproc == gpu ]] || launch_check_count "--nproc-per-node (or GPUS_PER_NODE)" "$nproc" 1
}

# The program torchrun starts on every rank: the package's entry by default, a Python file
# given with --script (e.g. a Megatron-LM checkout's pretrain_vlm.py patched for --omnibal), or
# a module given with --module (megatron_omnibal.preflight: the preflight of the same flags).
launch_entry() {
    [[ -z $script || -z $module ]] || launch_die "--script and --module: give one of them"
    if [[ -n $module ]]; then
        entry=(-m "$module")
    elif [[ -n $script ]]; then
        [[ -f $script ]] || launch_die "--script: no such file: $script"
        launch_check_handover
        entry=("$script")
    else
        entry=(-m megatron_omnibal.pretrain_vlm)
    fi
}

# A Megatron-LM pretrain_vlm.py run with --omnibal* flags must carry the current patch. Without
# it Megatron-LM fails with an error that does not say why (on Python 3.11 an ImportError of
# typing.override, on 3.12 "unrecognized arguments: --omnibal"); with the first version of the
# patch its torch_dist checkpoint writer fails the same way in a helper process.
launch_check_handover() {
    [[ $(basename "$script") == pretrain_vlm.py ]] || return 0
    local arg omnibal=0
    for arg in "${passthrough[@]}"; do
        [[ $arg == --omnibal* ]] && omnibal=1
    done
    ((omnibal)) || return 0
    local dir
    dir=$(cd "$(dirname "$script")" && pwd)
    grep -q "from megatron_omnibal.megatron.training import handover" "$script" && return 0
    grep -q "megatron_omnibal" "$script" &&
        launch_die "$script carries an older megatron-omnibal patch: restore it (git -C $dir checkout -- pretrain_vlm.py) and run scripts/apply_megatron_patch.sh $dir"
    launch_die "$script is not patched for --omnibal (its Megatron-LM would fail on the --omnibal* flags): run scripts/apply_megatron_patch.sh $dir"
}

# Environment and extra Megatron flags of the CPU mode: gloo instead of NCCL, one OpenMP thread
# per rank (ranks share the cores), no GPU visible (so the package's CPU layer takes over even
# on a GPU machine) and no TorchDynamo (seconds of start-up for nothing on CPU).
launch_cpu_env() {
    env_vars=()
    ((cpu_mode)) || return 0
    env_vars=(
        "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"
        "TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}"
        "CUDA_VISIBLE_DEVICES="
    )
    local arg
    for arg in "${passthrough[@]}"; do
        [[ $arg == --distributed-backend || $arg == --distributed-backend=* ]] && return 0
    done
    passthrough+=(--distributed-backend gloo)
}

# torchrun itself: $TORCHRUN if set (split on spaces, e.g. "python -m torch.distributed.run"),
# else torchrun from PATH.
launch_torchrun() {
    if [[ -n ${TORCHRUN:-} ]]; then
        read -r -a torchrun <<<"$TORCHRUN"
    else
        torchrun=(torchrun)
    fi
}

# Run (or with --dry-run print, shell-quoted on one line) the command. $@: torchrun's own
# arguments (nodes, processes, rendezvous).
launch_exec() {
    local cmd=()
    ((${#env_vars[@]})) && cmd+=(env "${env_vars[@]}")
    cmd+=("${torchrun[@]}" "$@" "${entry[@]}" "${passthrough[@]}")
    if ((dry_run)); then
        local quoted
        printf -v quoted '%q ' "${cmd[@]}"
        echo "${quoted% }"
        return 0
    fi
    exec "${cmd[@]}"
}
