"""actx reader: random access and shuffled batches of stored activations.

Imports neither apache_beam nor jax (jax only when JAX arrays are asked for).

    import reader
    run = reader.open_run("gs://bucket/runs/r1")
    with run.batches("layers.12.resid_post", batch_size=4096, seed=0,
                     process_index=i, process_count=n) as batches:
        for batch in batches:
            train_step(batch.acts["layers.12.resid_post"])
"""

from reader.batches import Batch, TokenBatches
from reader.errors import NotARunError, ReaderError, UncommittedPartitionError, UnknownHookError
from reader.provenance import Selection
from reader.run import HookInfo, Run, open_run
from reader.shuffle import ShufflePlan, TokenIndex, build_index
from reader.stats import HookStats, compute_stats, load_stats

__all__ = [
    "Batch", "HookInfo", "HookStats", "NotARunError", "ReaderError", "Run", "Selection",
    "ShufflePlan", "TokenBatches", "TokenIndex", "UncommittedPartitionError",
    "UnknownHookError", "build_index", "compute_stats", "load_stats", "open_run",
]
