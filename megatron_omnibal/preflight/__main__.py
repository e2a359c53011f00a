"""`python -m megatron_omnibal.preflight <training's flags> --out report.json` (under torchrun)."""

import sys

from megatron_omnibal.preflight.run import main

sys.exit(main())
