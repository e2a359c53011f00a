#!/usr/bin/env bash
# Launch megatron-omnibal training on several nodes with torchrun: run this once on every node,
# each with its own node rank, all pointing at the same rendezvous endpoint.
set -euo pipefail

launch_usage() {
    cat <<'USAGE'
Usage: scripts/launch_multi_node.sh [--nnodes N] [--node-rank R] [--cpu] [--nproc-per-node N]
                                    [--script FILE | --module NAME] [--dry-run]
                                    [MEGATRON AND --omnibal* FLAGS...] [-- FLAGS...]

Run it on every node. Starts torchrun for node R of N, running `python -m
megatron_omnibal.pretrain_vlm` (or FILE, e.g. a Megatron-LM checkout's pretrain_vlm.py patched
by scripts/apply_megatron_patch.sh; then pass --omnibal) with every other flag, in order.

  --nnodes N           number of nodes (default: $NNODES, else $SLURM_NNODES)
  --node-rank R        this node's rank, 0..N-1 (default: $NODE_RANK, else $SLURM_NODEID;
                       0 when N is 1)
  --cpu                CPU processes: gloo (adds --distributed-backend gloo), OMP_NUM_THREADS=1,
                       no GPU visible, TORCHDYNAMO_DISABLE=1
  --nproc-per-node N   processes per node (default: $GPUS_PER_NODE, else one per GPU;
                       with --cpu: 2)
  --script FILE        run this Python file instead of the package's entry
  --module NAME        run this module instead (megatron_omnibal.preflight: the preflight)
  --dry-run            print the command (shell-quoted, one line) instead of running it
  --                   pass everything after it through unread

Rendezvous endpoint: $RDZV_ENDPOINT (host:port), else $MASTER_ADDR:$MASTER_PORT (port default
29500), the same on every node. Rendezvous backend: $RDZV_BACKEND, default static (node ranks
as given); with RDZV_BACKEND=c10d, torchrun's elastic rendezvous (id $RDZV_ID, default omnibal)
assigns node ranks itself and --node-rank is not passed.
Environment also: TORCHRUN (default: torchrun), OMP_NUM_THREADS (--cpu: 1).
USAGE
}

# shellcheck source=scripts/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

launch_parse_args 1 "$@"
nnodes=${nnodes:-${NNODES:-${SLURM_NNODES:-}}}
node_rank=${node_rank:-${NODE_RANK:-${SLURM_NODEID:-}}}
[[ -n $nnodes ]] || launch_die "number of nodes unknown: pass --nnodes or set NNODES"
launch_check_count "--nnodes (or NNODES)" "$nnodes" 1
((10#$nnodes > 1)) || node_rank=${node_rank:-0}
backend=${RDZV_BACKEND:-static}
case "$backend" in
    static)
        [[ -n $node_rank ]] || launch_die "node rank unknown: pass --node-rank or set NODE_RANK"
        launch_check_count "--node-rank (or NODE_RANK)" "$node_rank" 0
        ((10#$node_rank < 10#$nnodes)) ||
            launch_die "--node-rank $node_rank is out of range for $nnodes nodes (0..$((nnodes - 1)))"
        ;;
    c10d) ;;
    *) launch_die "RDZV_BACKEND must be static or c10d, got '$backend'" ;;
esac

if [[ -n ${RDZV_ENDPOINT:-} ]]; then
    endpoint=$RDZV_ENDPOINT
elif [[ -n ${MASTER_ADDR:-} ]]; then
    endpoint=$MASTER_ADDR:${MASTER_PORT:-29500}
else
    launch_die "rendezvous endpoint unknown: set MASTER_ADDR (and MASTER_PORT) or RDZV_ENDPOINT"
fi
[[ $endpoint =~ ^[^:]+:[0-9]+$ || $endpoint =~ ^\[.+\]:[0-9]+$ ]] ||
    launch_die "rendezvous endpoint must be host:port, got '$endpoint'"

launch_resolve_nproc
launch_entry
launch_cpu_env
launch_torchrun
if [[ $backend == static ]]; then
    launch_exec --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc" \
        --rdzv-backend static --rdzv-endpoint "$endpoint"
else
    launch_exec --nnodes "$nnodes" --nproc-per-node "$nproc" \
        --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "${RDZV_ID:-omnibal}"
fi
