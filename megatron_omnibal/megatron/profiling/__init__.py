"""`omnibal profile`: real megatron-core layers measured for the planner's cost model."""
