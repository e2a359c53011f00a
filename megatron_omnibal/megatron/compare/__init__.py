"""Checking a converted model: probe inputs and the torchrun worker of `omnibal compare-hf`."""
