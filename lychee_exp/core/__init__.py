"""The library: config schema, data, prompts, models, losses, optimizers, evaluation, devices and process groups.

Everything a training run is built from, usable alone (a notebook can load data and score pairs with it).
May import: nothing else of lychee_exp."""
