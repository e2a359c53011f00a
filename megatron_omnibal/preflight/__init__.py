"""`python -m megatron_omnibal.preflight` (under torchrun): run a plan's own stages for a few
steps before the long run and check each stage's memory and time against the plan.

`torchrun ... -m megatron_omnibal.preflight <training's flags> --out report.json` trains a few
steps through the training entry point (megatron/training/pretrain_vlm.py) on the largest
micro-batches the plan's budgets allow and on typical ones from the length file, measures every
stage, and
exits non-zero when a stage would run out of memory (docs/preflight.md).
"""
