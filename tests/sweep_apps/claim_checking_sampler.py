"""A RandomSampler that refuses to draw for a trial no worker has claimed yet (no `worker` attribute): a
model-based sampler can take longer than the grace period, after which other workers fail unclaimed trials."""

import optuna


class ClaimCheckingSampler(optuna.samplers.RandomSampler):
    def sample_independent(self, study, trial, param_name, param_distribution):
        if "worker" not in study._storage.get_trial(trial._trial_id).user_attrs:
            raise RuntimeError(f"trial {trial.number} was sampled before its worker claimed it")
        return super().sample_independent(study, trial, param_name, param_distribution)
