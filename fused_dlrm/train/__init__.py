"""Training: the loop, its builders, checkpoints, metrics and the run directory."""
