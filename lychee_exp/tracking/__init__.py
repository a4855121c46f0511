"""What a run records and shows: metric names (keys, the one source), logging backends (metrics.csv, W&B,
TensorBoard), console lines, throughput and speedup, W&B record reading, the dashboard and the local report; a sweep
trial's identity and rank 0's pruning callback (trial). May import: parallel, model, config, io, errors (never the
recipe: the recipe calls it)."""
