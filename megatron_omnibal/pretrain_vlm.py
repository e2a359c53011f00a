"""`python -m megatron_omnibal.pretrain_vlm <Megatron flags> --omnibal ...` (see megatron/)."""

import sys

from megatron_omnibal.megatron.training.pretrain_vlm import run_entry

if __name__ == "__main__":
    sys.exit(run_entry())
