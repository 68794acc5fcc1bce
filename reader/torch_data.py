"""A PyTorch `IterableDataset` over `run.stream`: float batches for a DataLoader with any
number of workers, in any number of training processes.

Each (process, worker) pair reads its own share of the run: the stream's process
rank * num_workers + worker of world_size * num_workers, so the shares are disjoint and together hold every kept token once per epoch (drop_last=False) or the
same number of full batches each (drop_last=True, the default). Items are whole batches,
so use `DataLoader(dataset, batch_size=None)`. Tensorstore refuses to run in a forked
process (it aborts: its threads would be lost), so DataLoader workers must be started
with "spawn" or "forkserver": `dataset.loader(num_workers)` makes such a DataLoader.

Resuming: a DataLoader hands out its workers' batches in turn (worker 0, 1, ..., 0, 1,
...), so after a process has taken n batches, worker w has produced those of the indices
i < n with i % num_workers == w. `state_dict(n)` records n and the settings;
`ActivationDataset(..., resume=state)` starts every worker's stream right after its last
batch taken, the parts turned so the new DataLoader's worker 0 goes on with part n %
num_workers: the batches come in the order they would have without the stop. Exact when every share has the same number of batches (drop_last=True);
with drop_last=False, until the first share runs out at the end of the run.

Imported only by whoever asks for it (`reader.torch_data`): the reader itself never
imports torch.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np

from actx.reader import run as run_lib
from actx.schemas import errors

try:
    import torch
    from torch.utils import data as torch_data
except ImportError as e:
    from actx.schemas import version

    class MissingTorch(errors.UserError, ImportError):
        """This module without PyTorch: one line naming the extra that installs it."""

    raise MissingTorch(f"actx.reader.torch_data (ActivationDataset, ActivationBuffer) needs "
                       f"PyTorch, which is not installed here ({e}): pip install "
                       f"'{version.DISTRIBUTION}[torch]'") from None

STATE_VERSION = 1
_NUMPY_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64"}


def _default_rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ActivationDataset(torch_data.IterableDataset):
    """Batches of activations of a run, as float tensors [batch_size, hidden].

    run: a run location (path, gs://...) or an open `reader.Run` (its location is kept:
      each worker opens the run itself, so the dataset pickles).
    hooks: one hook (items are tensors) or several (items are dicts hook -> tensor).
    batch_size: tokens per item. rank / world_size: this training process and how many
      (default: torch.distributed's when initialised, else 0 / 1).
    seed / epochs / drop_last / exclude and any other keyword: as `run.stream`; with
      follow=True each worker follows a live run's commits for its share
      (reader.streaming.follow), and resume= continues in the commit order the markers'
      times give.
    dtype: the tensors' dtype (float32). device: where the tensors go, when iterated in
      this process (with DataLoader workers, move them in the loop, or pin_memory=True).
    with_tokens: items are (acts, tokens), tokens a dict of int64 tensors rows / cols /
      input_ids saying where each token of the batch is in the run.
    resume: a `state_dict(n)`: continue after the n batches this process had taken.
    extraction: which of the run's extractions to read (docs/several-models.md; default:
      the one an opened `run` was opened with, else the run's default one).
    """

    def __init__(self, run: "str | os.PathLike | run_lib.Run", hooks: "str | Sequence[str]",
                 batch_size: int, *, rank: int | None = None, world_size: int | None = None,
                 seed: int = 0, epochs: int | None = 1, drop_last: bool = True,
                 dtype: torch.dtype = torch.float32, device: "str | torch.device | None" = None,
                 with_tokens: bool = False, resume: dict | None = None,
                 extraction: str | None = None, **stream_kwargs: Any):
        super().__init__()
        if isinstance(run, run_lib.Run):  # an opened run: its location and extraction
            self.uri = str(run.location)
            extraction = run.extraction if extraction is None else extraction
        else:
            self.uri = os.fspath(run)
        self.extraction = extraction or ""
        self.hooks = (hooks,) if isinstance(hooks, str) else tuple(hooks)
        self.single = isinstance(hooks, str)
        # Here, in the training process: a hook the run lacks is one line naming it and
        # the run's hooks, not a traceback from a DataLoader worker.
        opened = (run if isinstance(run, run_lib.Run)
                  else run_lib.open_run(self.uri, self.extraction))
        for hook in self.hooks:
            opened.hook(hook)
        default_rank, default_world = _default_rank_world()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} must be in [0, world_size={self.world_size})")
        self.batch_size, self.seed, self.epochs, self.drop_last = batch_size, seed, epochs, \
            drop_last
        self.dtype, self.device, self.with_tokens = dtype, device, with_tokens
        self.stream_kwargs = stream_kwargs
        self.batches_taken = 0
        if resume is not None:
            if resume.get("version") != STATE_VERSION or resume.get("settings") != \
                    self._settings():
                raise ValueError(f"resume: a state of other settings ({resume.get('settings')}"
                                 f"), not of this dataset ({self._settings()})")
            self.batches_taken = int(resume["batches_taken"])

    def _settings(self) -> dict:
        settings = {"uri": self.uri, "hooks": list(self.hooks), "batch_size": self.batch_size,
                    "rank": self.rank, "world_size": self.world_size, "seed": self.seed,
                    "epochs": self.epochs, "drop_last": self.drop_last,
                    "stream": {k: repr(v) for k, v in sorted(self.stream_kwargs.items())}}
        if self.extraction:  # absent for the default one: states saved before still resume
            settings["extraction"] = self.extraction
        return settings

    def state_dict(self, batches_taken: int) -> dict:
        """What to save after this process took `batches_taken` batches in all (counting
        those before a resume) from a DataLoader over this dataset."""
        return {"version": STATE_VERSION, "batches_taken": int(batches_taken),
                "settings": self._settings()}

    def loader(self, num_workers: int = 0, *, multiprocessing_context: str = "spawn",
               **kwargs: Any) -> torch_data.DataLoader:
        """A DataLoader over this dataset: whole batches (batch_size=None), its workers
        started without fork (see the module docstring)."""
        if num_workers > 0:
            kwargs.setdefault("multiprocessing_context", multiprocessing_context)
            kwargs.setdefault("persistent_workers", False)
        return torch_data.DataLoader(self, batch_size=None, num_workers=num_workers, **kwargs)

    def share(self) -> tuple[int, int, int]:
        """(stream process index, process count, worker count) of the calling worker."""
        info = torch_data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return self.rank * workers + worker, self.world_size * workers, workers

    def open_stream(self):
        """The calling worker's `run.stream`, started after the batches already taken."""
        from actx import reader

        index, count, workers = self.share()
        # The DataLoader starts again at its worker 0, so after n batches its worker w
        # takes the part of the worker (w + n) % workers had, to keep the same order.
        role = (index - self.rank * workers + self.batches_taken) % workers
        index = self.rank * workers + role
        # Batches i < batches_taken with i % workers == role were that part's.
        done = max(0, -(-(self.batches_taken - role) // workers))
        kwargs = dict(self.stream_kwargs)
        # The cast runs on the stream's prefetch thread, in numpy: torch's bfloat16 ->
        # float32 took 24 ms per 4096 x 896 batch here, numpy's (ml_dtypes) 1.6 ms.
        kwargs.setdefault("dtype", _NUMPY_DTYPES.get(self.dtype))
        return reader.open_run(self.uri, self.extraction).stream(
            self.hooks, self.batch_size, seed=self.seed, epochs=self.epochs,
            drop_last=self.drop_last, process_index=index, process_count=count,
            start_step=done, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        in_worker = torch_data.get_worker_info() is not None
        device = torch.device(self.device) if self.device is not None else None
        if in_worker and device is not None and device.type != "cpu":
            raise ValueError(f"device={device}: tensors cannot be put on {device.type} in "
                             f"DataLoader workers; leave device=None and move each batch "
                             f"in the loop (pin_memory=True makes that faster)")
        with self.open_stream() as stream:
            for batch in stream:
                acts = {h: _tensor(a, self.dtype, device) for h, a in batch.acts.items()}
                # One hook: its array (keyed by its stored name, a TransformerLens
                # name resolved).
                out = next(iter(acts.values())) if self.single else acts
                if self.with_tokens:
                    tokens = {"rows": torch.from_numpy(np.asarray(batch.rows, np.int64)),
                              "cols": torch.from_numpy(np.asarray(batch.cols, np.int64)),
                              "input_ids": torch.from_numpy(
                                  np.asarray(batch.input_ids, np.int64))}
                    out = (out, tokens)
                yield out


def _tensor(array: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    """The batch array as a tensor, cast (no copy when it has the dtype already: the
    tensor then holds the array, and the stream reuses it only once the tensor is gone)."""
    if array.dtype.name == "bfloat16":
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(dtype)
    else:
        tensor = torch.from_numpy(array).to(dtype)
    return tensor if device is None else tensor.to(device, non_blocking=True)
