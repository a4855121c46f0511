"""The one room for what measures or stress-checks lychee_exp; may import every layer, test support included.
Each is run from the repository root as `python -m benchmarks.<name>` (the side-by-side ones share
`harness.py`: rounds in turns, medians, ratio to the fastest peer, CSV/markdown):

- `scaling` (also `python -m benchmarks`): training speed over device counts
- `peers` (+ `peer_loops`, `peer_batches`): lychee_exp against HF Trainer, a bare loop, sentence-transformers, on
  identical batches; `own_batching` (+ `own_batching_loops`): each system batching the data file its own way
- `step_vs_bare`: lychee_exp's step against a bare loop on the same pairs, profiled per operator group
- `padded_vs_packed`, `step_profile`, `tokenize_startup`, `ir_throughput`, `checkpoint_write`, `yes_no_head`: one
  part of a run timed
- `sweep_overhead`, `sweep_throughput`, `optuna_storage`: sweeps
- `stress_launch`: many DDP launches back to back in one process, failures counted
- `gpu_check` (+ `gpu/`): the GPU acceptance check, run as `bash benchmarks/gpu_check.sh`
  (`gpu_wheels.sh` gathers the wheels a GPU machine without network needs)
"""

# first, before any benchmark imports numpy, torch or matplotlib: lychee_exp/__init__ makes Ctrl-C (and a stop
# signal) while a benchmark still imports one line and exit 130, as for the package's own commands
import lychee_exp  # noqa: E402, F401
