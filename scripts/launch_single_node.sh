#!/usr/bin/env bash
# Launch megatron-omnibal training on one node with torchrun: one process per GPU by default,
# or CPU processes with gloo (--cpu) to dry-run a configuration before spending GPU hours.
set -euo pipefail

launch_usage() {
    cat <<'USAGE'
Usage: scripts/launch_single_node.sh [--cpu] [--nproc-per-node N] [--script FILE | --module NAME]
                                     [--dry-run] [MEGATRON AND --omnibal* FLAGS...] [-- FLAGS...]

Starts `torchrun --standalone --nnodes 1` on this node, running `python -m
megatron_omnibal.pretrain_vlm` (or FILE, e.g. a Megatron-LM checkout's pretrain_vlm.py patched
by scripts/apply_megatron_patch.sh; then pass --omnibal) with every other flag, in order.

  --cpu                CPU processes: gloo (adds --distributed-backend gloo), OMP_NUM_THREADS=1,
                       no GPU visible, TORCHDYNAMO_DISABLE=1
  --nproc-per-node N   processes on this node (default: $GPUS_PER_NODE, else one per GPU;
                       with --cpu: 2)
  --script FILE        run this Python file instead of the package's entry
  --module NAME        run this module instead (megatron_omnibal.preflight: the preflight)
  --dry-run            print the command (shell-quoted, one line) instead of running it
  --                   pass everything after it through unread

Environment: GPUS_PER_NODE, TORCHRUN (default: torchrun), OMP_NUM_THREADS (--cpu: 1).
USAGE
}

# shellcheck source=scripts/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

launch_parse_args 0 "$@"
launch_resolve_nproc
launch_entry
launch_cpu_env
launch_torchrun
launch_exec --standalone --nnodes 1 --nproc-per-node "$nproc"
