"""Planner: cost model, pipeline simulator, partition search, memory and recompute, plan.json.

Rooms, each importing only those before it: simulator, cost_model, plan_file, search, packing;
make.py puts them together (docs/architecture.md).
"""
