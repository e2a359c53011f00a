"""Checkpoints of the VLM stages: Hugging Face <-> Megatron conversion, tensor-parallel shards,
reading a checkpoint back, and the resume checks made before any process group."""
