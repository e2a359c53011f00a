"""Data side: length statistics, balancing (ISF/HBP), balance metrics and the balanced sampler."""
