"""`python -m lychee_exp.dashboard --entity E --project P [--save | --dry-run out.json]`: the W&B workspace that
compares a project's runs (lychee_exp.tracking.wandb_workspace)."""

import sys

from lychee_exp.tracking.wandb_workspace import main

if __name__ == "__main__":
    sys.exit(main())
