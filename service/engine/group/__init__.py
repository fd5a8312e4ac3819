"""One model over several hosts: an MLX ring group whose rank 0 is the engine (SPEC §17,
docs/distributed.md).

Every rank runs the same engine loop (worker.Engine) on the same commands, in the same
order: rank 0 takes them from the server's pipe and shares each loop's batch of them with
the others (``Tick``), so each rank's batches, caches and samplers move in step, and only
the model's forward pass crosses hosts. ``ring.Group`` is the group (start, the versions and
model files checked alike, ticks, the watchdog that ends a rank whose peer went silent);
``pipeline`` splits a model by layers; ``join`` is ``lmspd engine join``, the other hosts'
long-running side.
"""
