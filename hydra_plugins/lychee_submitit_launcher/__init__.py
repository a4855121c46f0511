"""hydra-submitit-launcher launchers whose requeued jobs continue the same run (conf/hydra/launcher/slurm*.yaml)."""
