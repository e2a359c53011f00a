"""`omnibal stats`: a dataset's length statistics, a model's data side, plots."""
