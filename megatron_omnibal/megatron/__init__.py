"""Megatron layer: adapts the balancer and the plan to megatron-core (never imported by them).

Rooms, each importing only those before it: runtime, stream, stages, flags, checkpoint,
training; compare and profiling on top (docs/architecture.md).
"""
