"""A user's Flax NNX model (`model.flax`): `model` (factory, call signature, packing it can
serve), `hooks` (module paths with a point), `step` (the jitted step), `worker` (the same
loop with another model; `worker_for_run` picks the worker a run needs) and `preflight`.
Flax is imported here and nowhere else, and only when a run uses it."""
