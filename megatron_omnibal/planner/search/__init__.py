"""The searches: pipeline partition (heuristic and certified exact), recompute per stage,
parallel sizes, one configuration's setting, and the hand-set Megatron baseline. Pure numpy."""
