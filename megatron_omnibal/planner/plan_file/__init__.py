"""plan.json: the `Plan` type, its field-by-field JSON, the provenance of its inputs and the
Megatron-LM flags it becomes. Pure Python."""
