"""Model specs: one type for the planner, the Megatron stage module and the HF converters."""
