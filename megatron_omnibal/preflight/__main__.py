"""`python -m megatron_omnibal.preflight <training's flags> --out report.json` (under torchrun)."""

import sys

from megatron_omnibal.megatron.runtime.shutdown import end_process_group
from megatron_omnibal.preflight.run import main

status = main()
end_process_group()
sys.exit(status)
