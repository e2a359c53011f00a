"""What a layer, a stage and a micro-batch cost: GPU presets, FLOPs, per-layer time and memory
(analytic or measured), drawn workloads. Pure numpy."""
