"""Many devices: which devices a run uses (devices), this process's place in the run, its collectives and its seeds
(distributed), FSDP2 sharding (sharding), per-device memory before a run starts (memory_plan). May import: model,
data, config, io, errors."""
