"""Aligned batches across extractions: the same tokens from several models, one batch.

What crosscoders and model diffing read: a run with extractions `base` and `chat`
(schemas.extraction) holds two models' activations over one token store; an
`AlignedStream` gives batches in which row i is the same token (run row, column) in every
model, `[batch, n_models, d]` when the hooks read share one width, else one array per
extraction.

It is one `reader.streaming.stream.ShuffledStream` per extraction, opened with the same settings
over the same partitions (those committed in every extraction) and the same token filter.
A stream's order depends only on its seed, the sizes, the process split and which tokens
are valid, never on the activations, so the streams walk the tokens in one order; each
batch is checked to pair the same tokens (a mismatch raises, it is never returned).
Normalisation is per model (`normalize=`: each extraction's own statistics, from its own
`compute_stats`). A mask that depends on one model's activations ("outlier") would keep
other tokens in each stream, so it is refused here.

With follow=True (a live run, reader.streaming.follow) the streams share one follower:
a partition joins their commit order once it is committed in every extraction, so they
take the same windows, and each batch pairs the same tokens as on a finished run.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from actx.reader import errors
from actx.reader import run as run_lib
from actx.reader.streaming import follow as follow_lib
from actx.schemas import advice

STATE_VERSION = 1


@dataclasses.dataclass
class AlignedBatch:
    """One process's aligned batch at a global step.

    acts: `[n, n_models, d]` (models in `extractions` order) when every hook read has one
      width, else {extraction: [n, d]}; numpy, torch or jax as the streams give them.
    extractions: the extraction names, in the order of acts' second axis.
    hooks: the hook read in each extraction.
    rows / cols / input_ids: where each token lives in the run and its id, as in
      reader.batches.Batch (the same for every model).
    """

    step: int
    epoch: int
    acts: Any
    extractions: tuple[str, ...]
    hooks: dict[str, str]
    rows: np.ndarray
    cols: np.ndarray
    input_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def open_runs(uri, extractions: Sequence[str]) -> dict[str, run_lib.Run]:
    """Each named extraction of the run at `uri` opened for reading ("" the default)."""
    if len(set(extractions)) != len(extractions) or len(extractions) < 1:
        raise ValueError(f"extractions: name each extraction once, got {list(extractions)}")
    return {name: run_lib.open_run(uri, extraction=name) for name in extractions}


class AlignedStream:
    """Aligned shuffled batches over extractions of one run (see the module docstring).

    runs: {extraction: Run} (`open_runs`) or a run location with `extractions` given.
    hooks: the hook read from every extraction (one name), or {extraction: hook}.
    batch_size and every other keyword: as for `run.stream` (reader.streaming.stream.ShuffledStream):
      seed, epochs, process_index / process_count, drop_last, whole_document, exclude (but
      not "outlier"), partitions, buffer_tokens, normalize (per model), framework, ...
    resume: a dict from `state(batch)`.
    """

    def __init__(self, runs: "Mapping[str, run_lib.Run] | str", hooks: "str | Mapping[str, str]",
                 batch_size: int, *, extractions: Sequence[str] | None = None,
                 partitions: Sequence[int] | None = None, resume: dict | None = None,
                 **stream_options):
        if not isinstance(runs, Mapping):
            if extractions is None:
                raise ValueError("extractions: name the extractions to read (e.g. "
                                 "['base', 'chat']) when giving a run location")
            runs = open_runs(runs, extractions)
        self.runs = dict(runs)
        self.extractions = tuple(self.runs)
        if len(self.extractions) < 2:
            raise ValueError(f"extractions: aligned batches need two or more, got "
                             f"{list(self.extractions)}")
        self.hooks = ({name: hooks for name in self.extractions} if isinstance(hooks, str)
                      else {name: hooks[name] for name in self.extractions})
        if "outlier" in (stream_options.get("exclude") or ()):
            raise ValueError("exclude: 'outlier' depends on each model's own activations, "
                             "so the models would keep different tokens; aligned batches "
                             "take the token masks only (special, bos, padding, "
                             "doc_boundary)")
        first = next(iter(self.runs.values()))
        for name, run in self.runs.items():
            if run.spec.tokens_fingerprint != first.spec.tokens_fingerprint \
                    or run.location != first.location:
                raise ValueError(f"extraction {name!r}: not over the same token store as "
                                 f"{self.extractions[0]!r}; aligned batches read one run")
            if not stream_options.get("follow"):
                run.require_commits()
        # As stored: a TransformerLens name resolved on each run's model.
        self.hooks = {name: run.resolve_hook(self.hooks[name])
                      for name, run in self.runs.items()}
        if resume is not None:
            self._check_resume(resume)
        follower = None
        if stream_options.get("follow"):
            # Following a live run: one follower for every extraction, so their streams
            # take the same windows, of the partitions committed in all of them.
            self.partitions = None if partitions is None else tuple(sorted(set(partitions)))
            follower = self._follower(resume, stream_options)
        else:
            self.partitions = self._common_partitions(partitions)
        self.streams = {
            name: run.stream(self.hooks[name], batch_size, partitions=self.partitions,
                             resume=None if resume is None else resume["streams"][name],
                             _follower=follower, **stream_options)
            for name, run in self.runs.items()}
        # Known once a partition is committed (a followed run's first batch, at the latest).
        self._stacked: bool | None = None

    def _follower(self, resume: dict | None, stream_options: dict):
        names = {f.name for f in dataclasses.fields(follow_lib.FollowOptions)}
        options = follow_lib.FollowOptions(**{k: v for k, v in stream_options.items()
                                              if k in names})
        options.check()
        recorded = options.commit_order or ()
        if resume is not None:
            recorded = resume["streams"][self.extractions[0]].get("commit_order") or ()
        follower = follow_lib.CommitFollower(list(self.runs.values()), self.partitions,
                                             options, threading.Event(), recorded)
        follower.poll()
        return follower

    @property
    def stacked(self) -> bool:
        """Whether the models' activations are stacked ([n, models, d]: one width)."""
        if self._stacked is None:
            widths = {run.hook(self.hooks[name]).hidden for name, run in self.runs.items()}
            self._stacked = len(widths) == 1
        return self._stacked

    def _common_partitions(self, partitions: Sequence[int] | None) -> tuple[int, ...]:
        """The partitions committed in every extraction (of `partitions`, when given)."""
        common = set.intersection(*(set(run.committed) for run in self.runs.values()))
        if partitions is not None:
            wanted = set(partitions)
            behind = {name: sorted(wanted - set(run.committed))
                      for name, run in self.runs.items() if wanted - set(run.committed)}
            if behind:
                raise errors.UncommittedPartitionError(
                    f"partitions not committed in every extraction: {behind}; "
                    f"`{advice.rerun(next(iter(self.runs.values())).location)}` finishes them")
            common &= wanted
        if not common:
            raise errors.NothingCommittedError(
                f"{next(iter(self.runs.values())).location}: no partition is committed in "
                f"every one of {list(self.extractions)}; "
                f"`{advice.status(next(iter(self.runs.values())).location)}` shows each one's "
                f"progress")
        return tuple(sorted(common))

    def _check_resume(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION or set(state.get("streams", {})) \
                != set(self.extractions):
            raise ValueError(f"resume: not an aligned stream state of version "
                             f"{STATE_VERSION} for {list(self.extractions)}; save it with "
                             f"stream.state(batch)")

    # -- iteration ----------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        return next(iter(self.streams.values())).steps_per_epoch

    def __len__(self) -> int:
        return len(next(iter(self.streams.values())))

    def __iter__(self):
        iterators = {name: iter(stream) for name, stream in self.streams.items()}
        while True:
            batches = {}
            for name, it in iterators.items():
                batch = next(it, None)
                if batch is None:
                    if batches:
                        raise errors.ReaderError(
                            f"aligned streams ended apart: {sorted(batches)} have a batch "
                            f"where {name!r} has none")
                    return
                batches[name] = batch
            yield self._combine(batches)

    def _combine(self, batches: dict) -> AlignedBatch:
        first_name = self.extractions[0]
        first = batches[first_name]
        for name, batch in batches.items():
            if not (np.array_equal(batch.rows, first.rows)
                    and np.array_equal(batch.cols, first.cols)):
                raise errors.ReaderError(
                    f"aligned streams diverged at step {first.step}: {name!r} holds other "
                    f"tokens than {first_name!r}; open them with the same settings")
        acts = {name: batches[name].acts[self.hooks[name]] for name in self.extractions}
        if self.stacked:
            acts = _stack([acts[name] for name in self.extractions])
        return AlignedBatch(first.step, first.epoch, acts, self.extractions, dict(self.hooks),
                            first.rows, first.cols, first.input_ids)

    def state(self, batch: AlignedBatch) -> dict:
        """What to save to resume after `batch` (pass it back as `resume=`)."""
        return {"version": STATE_VERSION, "streams": {
            name: stream.state(_StepOnly(batch.step)) for name, stream in self.streams.items()}}

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()

    def __enter__(self) -> "AlignedStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass
class _StepOnly:
    """What ShuffledStream.state reads of a batch: its step."""

    step: int


def _stack(arrays: list) -> Any:
    """[n, d] arrays of one kind stacked into [n, n_models, d] (numpy, torch or jax)."""
    kind = type(arrays[0]).__module__.split(".")[0]
    if kind == "torch":
        import torch

        return torch.stack(arrays, dim=1)
    if kind in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.stack(arrays, axis=1)
    return np.stack(arrays, axis=1)


def aligned_stream(uri, extractions: Sequence[str], hooks: "str | Mapping[str, str]",
                   batch_size: int, **options) -> AlignedStream:
    """`AlignedStream` over extractions of the run at `uri` (see its docstring)."""
    return AlignedStream(uri, hooks, batch_size, extractions=extractions, **options)
