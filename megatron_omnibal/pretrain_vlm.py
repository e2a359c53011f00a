"""`python -m megatron_omnibal.pretrain_vlm <Megatron flags> --omnibal ...` (see megatron/).

The import stays under the main guard: a process started with multiprocessing's "spawn"
(megatron-core's torch_dist checkpoint writer starts a manager process at a rank's first save)
imports this module again as `__mp_main__`, and would otherwise import torch and megatron-core
(about 3 CPU seconds) for nothing.
"""

import sys

if __name__ == "__main__":
    from megatron_omnibal.megatron.training.pretrain_vlm import run_entry

    sys.exit(run_entry())
