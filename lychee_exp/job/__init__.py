"""One training job in the Hydra process: check, plan, launch, write metrics.json; and the same job run from Python
(in_process). May import: launch, train, tracking, ir, parallel, model, data, config, io, errors."""
