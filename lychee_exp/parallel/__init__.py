"""Many devices: which devices a run uses (devices), this process's place in the run and its collectives
(distributed), FSDP2 sharding (sharding), per-device memory before a run starts (memory_plan), seeds per process
(seeding). May import: model, data, config, io, errors."""
