"""`python -m megatron_omnibal.pretrain_vlm <Megatron flags> --omnibal ...` (see megatron/)."""

import sys

from megatron_omnibal.megatron.training.pretrain_vlm import main

if __name__ == "__main__":
    sys.exit(main())
