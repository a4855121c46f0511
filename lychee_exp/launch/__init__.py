"""Starting ranks: in this process, as elastic (torchrun-style) workers, as warm ranks kept across sweep trials,
under torchrun or SLURM; what a rank runs, how failures are reported, preemption, and the hooks handed to the
recipe. May import: train, tracking, ir, parallel, config, errors."""
