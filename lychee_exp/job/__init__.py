"""One training job in the Hydra process: check, plan, launch, write metrics.json.
May import: everything below it (core, tracking, recipe, launch)."""
