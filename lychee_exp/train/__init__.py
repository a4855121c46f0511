"""The training recipe on one rank: Trainer (setup, fit, save, cleanup), the accumulation-window step, progress and
checkpoints. May import: lychee_exp, lychee_exp.tracking."""
