"""Balancing: length statistics -> packs laid out over (step, DP rank, micro-batch).

config.py (BalanceConfig, PackCost, Level), balancer.py (balance()), packing.py and
hierarchy.py (one level's packs; levels, GreedyFill, step interleave), core.py (the C++ core
or its Python reference, reference.py), layout.py, budgets.py, metrics.py, checks.py, plan_io.py
(the plan .npz), sampler.py (resumable, per DP rank), mixes.py (generated long-tail mixes),
dp_balanced.py (Megatron-Core's dp_balanced packing scheduler, a baseline to compare with).
"""
