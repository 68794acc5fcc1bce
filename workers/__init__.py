"""actx workers: one extraction process per host, by role.

  main.py       `actx extract` / `python -m actx.workers.main`: the worker process (entry
                point for deploy/)
  preflight.py  what the workers would refuse, found before any work (entry point for
                deploy/); job_check.py, what it found
  model/        the decoder as data and pure functions: its config, the families, the
                checkpoint, RoPE, mixtures of experts, hooks (capture), the jitted step,
                the mesh's axes (sharding), a loaded model
  attention/    attention on each backend: the masks that define it, key ranges, the XLA
                and Pallas kernels, the per-slot KV cache
  loop/         the per-host loop: the runner, its session, partitions streamed through
                the batch slots, step planning, prefetch, transfers, outputs off the
                dispatching thread, progress and heartbeats, admission, several models
  replicas/     the hosts of a replica in lockstep (jax.distributed, the stop step) and
                replicas sharing partitions (the choice policy, the chooser's claims)
  write/        a host's shards written whole, and the commit rule
  generate/     a generating run: the generator, its step, sampling, text, its worker
  flax/         a user's Flax NNX model (`model.flax`): its model, hooks, step, worker,
                pre-flight; the only modules that import Flax

docs/ARCHITECTURE.md draws the map and the import directions.
"""
