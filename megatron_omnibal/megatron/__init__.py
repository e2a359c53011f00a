"""Megatron layer: adapts the balancer and the plan to megatron-core (never imported by them)."""
