"""actx reader: random access and shuffled batches of stored activations.

Imports neither apache_beam nor jax (jax only when JAX arrays are asked for).

    from actx import reader
    run = reader.open_run("gs://bucket/runs/r1")
    with run.stream("layers.12.resid_post", batch_size=4096, buffer_tokens=1 << 22,
                    seed=0, process_index=i, process_count=n) as batches:
        for batch in batches:
            train_step(batch.acts["layers.12.resid_post"])

Public names (all re-exported here; `__all__`):
    open_run(uri) -> Run          open a run (local path, gs://bucket/path, memory://name)
    Run                           reader.run (the front door): a snapshot of the
                                  committed partitions (reader.snapshot: hooks, rows /
                                  tokens / gather) handing over to document, select,
                                  stream, batches, compute_stats / stats
    HookInfo                      reader.snapshot: one hook's shape, dtype, partitions
    (reader.options)              the keywords stream and batches share, in groups
    ShuffledStream                reader.streaming.stream: `run.stream`, the streaming two-level
                                  shuffle training reads (near sequential speed);
                                  `state(batch)` / resume= (reader.streaming.state)
    FollowStream                  reader.streaming.follow: `run.stream(..., follow=True)`, a
                                  live run read as its partitions commit
    StreamPlan, BlockTable        reader.streaming.blocks: its row blocks, process split, buffers
    Mixing, measure_mixing        reader.streaming.mixing: documents / partitions / blocks per batch
    Batch, TokenBatches           reader.batches: `run.batches`, the exact global shuffle
    TokenIndex, build_index       reader.shuffle: the valid tokens, in row-major order
    ShufflePlan                   reader.shuffle: the seeded, process-split order
    Selection                     reader.provenance: tokens of a document / ARC filter
    HookStats                     reader.stats: mean / var / mean norm of one hook over
                                  the run's tokens
    compute_stats, load_stats     reader.stats: compute and store / load HookStats
    (reader.masks)                token masks: exclude=["special", "bos", "padding",
                                  "doc_boundary", "outlier"] in stream / batches / select
    (reader.torch_data)           ActivationDataset: a torch IterableDataset over
                                  run.stream for DataLoader workers x processes (not
                                  imported here: the reader never imports torch itself)
    (reader.trainers)             hand-offs to SAE trainers (dictionary_learning,
                                  SAELens); imported on demand
    ReaderError                   reader.errors: base of the errors below
    NotARunError                  no run.json / manifest.json at the location
    UnknownHookError              a hook no committed partition holds
    UncommittedPartitionError     rows of a partition without a commit marker
    NothingCommittedError         any read of a run with no committed partition yet
    RunStalledError               a followed run gave no commit for wait_timeout_s
    AmbiguousDocumentError        a doc_id that names several documents (the
                                  message lists their doc_index)
    LostDataError                 rows of a committed partition whose stored
                                  activations are gone (refused: they would read
                                  as zeros)

All tensorstore arrays are opened in the process-wide context (schemas.ts_context), so
memory:// runs written in the same process are readable and its cache pool is shared
(streams read activations in a child of it without a chunk cache: read_contexts).
"""

from actx.reader.batches import Batch, TokenBatches
from actx.reader.streaming.blocks import BlockTable, StreamPlan
from actx.reader.errors import (AmbiguousDocumentError, LostDataError, NotARunError,
                                NothingCommittedError,
                                ReaderError, RunStalledError, UncommittedPartitionError,
                                UnknownHookError)
from actx.reader.streaming.mixing import Mixing
from actx.reader.streaming.mixing import measure as measure_mixing
from actx.reader.provenance import Selection
from actx.reader.run import HookInfo, Run, open_run
from actx.reader.shuffle import ShufflePlan, TokenIndex, build_index
from actx.reader.stats import compute_stats
from actx.reader.stored_stats import HookStats, load_stats
from actx.reader.streaming.follow import FollowStream
from actx.reader.streaming.stream import ShuffledStream

__all__ = [
    "AmbiguousDocumentError", "Batch", "BlockTable", "FollowStream", "HookInfo", "HookStats", "LostDataError", "Mixing",
    "NotARunError", "NothingCommittedError",
    "ReaderError", "RunStalledError",
    "Run", "Selection", "ShufflePlan", "ShuffledStream", "StreamPlan", "TokenBatches",
    "TokenIndex", "UncommittedPartitionError", "UnknownHookError", "build_index",
    "compute_stats", "load_stats", "measure_mixing", "open_run",
]
