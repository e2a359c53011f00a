"""The data side of a plan: the balancer's pack cost from the cost model and the packing levels
of hierarchical balance packing. Pure numpy."""
