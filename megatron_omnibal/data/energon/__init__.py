"""Megatron-Energon datasets: read as a source of samples, written from the project's formats."""
