"""Planner: cost model, pipeline simulator, partition search, memory and recompute, plan.json."""
