#!/usr/bin/env bash
# Apply megatron-omnibal's patch to a Megatron-LM checkout, so that its pretrain_vlm.py hands a
# run with --omnibal to this package. Safe to run twice: a patched checkout is left as it is.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_file=${OMNIBAL_MEGATRON_PATCH:-$here/../patches/megatron-lm-core_v0.19.x-omnibal.patch}
expected_version=core_v0.19

usage() {
    cat <<'USAGE'
Usage: scripts/apply_megatron_patch.sh MEGATRON_LM_DIR

Patches MEGATRON_LM_DIR/pretrain_vlm.py (a git checkout of Megatron-LM, tag core_v0.19.x) so that
`pretrain_vlm.py --omnibal ...` runs megatron-omnibal's training; without --omnibal the script
behaves as before. Checks the patch with `git apply --check` before touching anything, and
exits 0 without changes when the patch is already applied.
Environment: OMNIBAL_MEGATRON_PATCH (another patch file, default: the shipped one).
USAGE
}

die() {
    echo "apply_megatron_patch.sh: error: $*" >&2
    exit 1
}

case "${1:-}" in
    -h | --help)
        usage
        exit 0
        ;;
esac
[[ $# -eq 1 ]] || {
    usage >&2
    exit 2
}
target=$1

command -v git >/dev/null || die "git not found on PATH (the patch is applied with git apply)"
[[ -f $patch_file ]] || die "patch file not found: $patch_file"
patch_file=$(cd "$(dirname "$patch_file")" && pwd)/$(basename "$patch_file")
[[ -d $target ]] || die "$target: no such directory (expected a Megatron-LM checkout)"
top=$(git -C "$target" rev-parse --show-toplevel 2>/dev/null) ||
    die "$target is not a git checkout (clone https://github.com/NVIDIA/Megatron-LM and check out tag ${expected_version}.x)"
[[ $(cd "$target" && pwd -P) == "$(cd "$top" && pwd -P)" ]] ||
    die "$target is inside the git checkout $top, not its top: pass $top"
[[ -f $top/pretrain_vlm.py ]] ||
    die "$top has no pretrain_vlm.py: not a Megatron-LM checkout, or a version without it"

version=$(git -C "$top" describe --tags --always 2>/dev/null || echo unknown)
commit=$(git -C "$top" rev-parse HEAD)
echo "Megatron-LM checkout: $top ($version, commit $commit)"
[[ $version == "$expected_version"* ]] ||
    echo "apply_megatron_patch.sh: warning: made for tag ${expected_version}.x, found $version; trying anyway" >&2

if git -C "$top" apply --check --reverse "$patch_file" 2>/dev/null; then
    echo "Already applied: $(basename "$patch_file"); nothing to do."
    exit 0
fi
if grep -q "megatron_omnibal" "$top/pretrain_vlm.py"; then
    die "$top/pretrain_vlm.py already carries another version of the megatron-omnibal patch; nothing was changed. Restore the file (git -C $top checkout -- pretrain_vlm.py) and run this script again"
fi
if ! errors=$(git -C "$top" apply --check "$patch_file" 2>&1); then
    echo "$errors" >&2
    die "$(basename "$patch_file") does not apply to $top ($version); nothing was changed. Is pretrain_vlm.py modified locally (git -C $top diff) or from another version than ${expected_version}.x?"
fi
git -C "$top" apply "$patch_file"
echo "Applied $(basename "$patch_file") to $top."
