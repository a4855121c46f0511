"""Metric names: the one source for what the loggers write, what the dashboard plots, what the report and
trials.csv read. A new W&B key is added here, then used by name."""

# History keys, one value per logged step or evaluation
HISTORY = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "samples_per_s": "train/samples_per_s",
    "tokens_per_s": "train/tokens_per_s",
    "data_wait": "train/data_wait_share",
    # the logged step's queries and real tokens over all ranks (a token budget's steps vary in both)
    "queries_per_step": "train/queries_per_step",
    "tokens_per_step": "train/tokens_per_step",
    "epoch": "epoch",
    # the model's own dev figures, logged by every run (runs before they were: only beside a mix)
    "dev_model_ndcg": "dev/model_ndcg@10",
    "dev_model_mrr": "dev/model_mrr@10",
    # the run's ranking: the model's scores mixed with the teacher's or the first stage's when data.teacher_weight
    # or data.first_stage_weight > 0 (ir/fusion.py; the run's `mix` names it), else the model's figures again
    "dev_ndcg": "dev/ndcg@10",
    "dev_mrr": "dev/mrr@10",
    # rank 0's GPU at each logged step (CUDA only; utilisation where NVML, the nvidia-ml-py package, is available)
    "gpu_memory_allocated": "gpu/memory_allocated_mb",
    "gpu_memory_reserved": "gpu/memory_reserved_mb",
    "gpu_peak_allocated": "gpu/peak_memory_allocated_mb",
    "gpu_peak_reserved": "gpu/peak_memory_reserved_mb",
    "gpu_utilization": "gpu/utilization_pct",
}
DEV_PREFIX = "dev/"  # every dev metric of an evaluation, e.g. dev/ndcg@10
# `num_devices` counts the devices whose batches make a step (DDP ranks or DataParallel GPUs); runs written before
# it existed call it `world_size`, which readers take as num_devices (num_devices() below).

# metrics.json facts kept on the trial (trials.csv columns; speedup and scaling_efficiency once runs have them)
TRIAL_METRICS = (
    "model_ndcg@10",
    "model_mrr@10",
    "ndcg@10",
    "mrr@10",
    "mix",
    "steps",
    "effective_batch_size",
    "per_device_batch_size",
    "num_devices",
    "grad_accum_steps",
    "lr",
    "base_lr",
    "train_time_s",
    "eval_time_s",
    "stopped_early",
    "stop_reason",  # pruned (the trial is PRUNED) or early_stopping (COMPLETE: trainer.early_stopping_patience)
    "best_step",  # the best dev evaluation's step (trainer.metric_for_best_model)
    "warm_ranks",
    "speedup",
    "scaling_efficiency",
)
# trials.csv, the sweep's table (lychee_exp.sweep.sweep_results writes it; the report reads it), then one column per
# searched parameter
TRIALS_CSV_COLUMNS = [
    "number",
    "state",
    "lr",
    "per_device_batch_size",
    "effective_batch_size",
    "metric",  # the optimized metric's value (optimization_results.yaml names it)
    "model_ndcg@10",  # the model's own dev figure
    "mix_ndcg@10",  # the mix's, blank for a trial ranked by the model alone
    "mix",  # what the mix mixes in ("the teacher at 0.7"), blank for none
    "duration_s",
    "reason",
    "steps",
    "train_time_s",
    "eval_time_s",
    "overhead_s",
    "warm_ranks",
    "speedup",
    "scaling_efficiency",
    "run_dir",
]


def num_devices(metrics: dict):
    """A run's device count, from its metrics (older runs: `world_size`)."""
    return metrics.get("num_devices", metrics.get("world_size"))
