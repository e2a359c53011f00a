"""Data side: datasets -> length statistics (stats, tiling, tokenization, templates)."""
