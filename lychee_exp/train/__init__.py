"""The training recipe on one rank: Trainer (setup, fit, save, cleanup) and what a rank trains on (trainer), the
accumulation-window step (step), losses, optimizer (optim), progress and step statistics (progress), the best dev
evaluation and early stopping (best), checkpoints and the saved model (checkpoint), the speedup baseline phase
(baseline_phase), what a run reads (inputs).
May import: tracking, ir, parallel, model, data, config, io, errors."""
