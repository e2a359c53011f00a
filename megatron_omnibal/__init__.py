"""megatron-omnibal: balanced data, model partition and recompute for VLM training on Megatron."""

__version__ = "0.1.0"
