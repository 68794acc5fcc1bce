"""Hand-offs to the SAE trainers people use, from a run's stream.

- dictionary_learning (saprmarks): `ActivationBuffer`, a drop-in for its ActivationBuffer:
  an endless iterator of float tensors [out_batch_size, d_submodule] on `device`, which is
  all its `trainSAE(data=buffer, ...)` reads (plus `config`, which it saves).
- SAELens: its `SAETrainer` takes `iter(reader.torch_data.ActivationDataset(...))` as its
  data provider as it is (docs/training.md), with no export. For its runner's
  cached-activations route, `export_saelens` writes its cached-activations layout, a HF
  `datasets` dataset saved with `save_to_disk` (what its CacheActivationsRunner writes and its
  ActivationsStore reads with `use_cached_activations=True, cached_activations_path=`):
  one column per hook of Array2D (context_size, d_in) and `token_ids` (context_size).
  Rows are `context_size` kept tokens in the stream's shuffled order (SAELens trains on
  single tokens, so a row need not be one sequence); a tail shorter than a row is dropped.
- sparsify and anything else that takes a DataLoader: `reader.torch_data.ActivationDataset`.

torch (for ActivationBuffer) and `datasets` (for the export) are imported by the
functions that use them, so the module imports without either (the export needs no torch).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from actx.reader import run as run_lib
from actx.schemas import errors

if TYPE_CHECKING:
    import torch

# The dtypes of the export's Array2D columns: the ones pyarrow stores (not bfloat16).
SAELENS_DTYPES = ("float32", "float16", "float64")

# actx hook point -> TransformerLens hook point (SAELens's hook names).
_TL_POINTS = {"resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid",
              "resid_post": "hook_resid_post", "attn_out": "hook_attn_out",
              "mlp_out": "hook_mlp_out"}


class MissingDatasets(errors.UserError, ImportError):
    """export_saelens without HF datasets: one line naming the extra that installs it."""


def _datasets():
    try:
        import datasets
    except ImportError as e:
        from actx.schemas import version

        raise MissingDatasets(f"actx.export_saelens writes SAELens's cached activations with "
                              f"HF datasets, which is not installed here ({e}): pip install "
                              f"'{version.DISTRIBUTION}[torch]'") from None
    return datasets


def transformer_lens_name(hook: str) -> str:
    """`layers.12.resid_post` -> `blocks.12.hook_resid_post` (SAELens's hook_name); other
    hooks keep their name."""
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)", hook)
    if m and m.group(2) in _TL_POINTS:
        return f"blocks.{m.group(1)}.{_TL_POINTS[m.group(2)]}"
    return {"embed": "hook_embed"}.get(hook, hook)


class ActivationBuffer:
    """dictionary_learning's ActivationBuffer, read from a run instead of a model.

    run: location or open Run; hook: the run's hook (the submodule's output).
    out_batch_size / device: as dictionary_learning's. epochs=None: endless, as theirs
    (trainSAE stops after `steps`). Other keywords go to `run.stream` (exclude=, seed=,
    normalize=, process_index= ...).
    """

    def __init__(self, run: "str | os.PathLike | run_lib.Run", hook: str,
                 out_batch_size: int = 8192, device: "str | torch.device" = "cpu", *,
                 epochs: int | None = None, **stream_kwargs: Any):
        from actx import reader
        from actx.reader import torch_data  # torch: only the buffer needs it

        self.run = run if isinstance(run, run_lib.Run) else reader.open_run(run)
        self.hook = hook
        self.d_submodule = self.run.hook(hook).hidden
        self.out_batch_size = out_batch_size
        self.device = device
        self._dataset = torch_data.ActivationDataset(
            self.run, hook, out_batch_size, epochs=epochs, device=device,
            rank=stream_kwargs.pop("process_index", 0),
            world_size=stream_kwargs.pop("process_count", 1), **stream_kwargs)
        self._batches: Iterator[torch.Tensor] | None = None

    @property
    def config(self) -> dict:
        """What trainSAE saves beside the dictionary."""
        return {"run": str(self.run.location), "hook": self.hook,
                "d_submodule": self.d_submodule, "out_batch_size": self.out_batch_size,
                "device": str(self.device)}

    def __iter__(self) -> "ActivationBuffer":
        return self

    def __next__(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = iter(self._dataset)
        return next(self._batches)

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()  # stops the stream's threads
            self._batches = None


def export_saelens(run: "str | os.PathLike | run_lib.Run", hooks: "str | Sequence[str]",
                   out_dir: str, *, context_size: int | None = None,
                   columns: Sequence[str] | None = None, dtype: str = "float32",
                   max_tokens: int | None = None, seed: int = 0, batch_size: int = 4096,
                   **stream_kwargs: Any) -> dict:
    """Writes SAELens's cached-activations dataset of `hooks` at `out_dir` (new or empty)
    from one epoch of `run.stream` (keywords such as exclude= go to it). columns: the
    dataset's column per hook (default: transformer_lens_name). dtype: the columns' dtype,
    one of SAELENS_DTYPES (pyarrow stores no bfloat16; anything else is refused before
    anything is written). context_size: kept tokens per row (default: the run's seq_len).
    max_tokens: an upper bound on the tokens written: floor(max_tokens / context_size)
    whole rows of context_size tokens (never a part row, so at most max_tokens; under
    one row, an empty dataset that still loads); None: every whole row of the epoch.

    Returns what to put in SAELens's config, plus the tokens written / dropped:
      one hook: `hook_name` (its column, a str) and `d_in` (an int), as SAELens's config
        takes them; `hook_names` is the one-element list;
      several hooks: `hook_names` (a list of columns) and `d_in` (a dict column -> width);
        no `hook_name` (a SAELens config trains one hook: pick one);
      always: context_size, tokens (written: rows * context_size), dropped_tokens (the
        kept tokens not written: the tail short of a row and what max_tokens left out, so
        tokens + dropped_tokens is the epoch's kept tokens), rows.
    """
    if context_size is not None and context_size < 1:
        raise ValueError(f"context_size must be positive, got {context_size}")
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (or None: every whole row), got "
                         f"{max_tokens}")
    if dtype not in SAELENS_DTYPES:
        raise ValueError(f"dtype {dtype!r}: SAELens's cached activations are stored by "
                         f"pyarrow, which takes {', '.join(SAELENS_DTYPES)}; pass one of "
                         f"those (float32 is what SAELens trains in)")
    datasets = _datasets()  # before anything is written
    from actx import reader

    run = run if isinstance(run, run_lib.Run) else reader.open_run(run)
    hooks = (hooks,) if isinstance(hooks, str) else tuple(hooks)
    run.read_dtype(hooks, dtype)  # a float8 run's dtypes, refused before anything is written
    columns = tuple(columns) if columns else tuple(transformer_lens_name(h) for h in hooks)
    if len(columns) != len(hooks) or len(set(columns)) != len(columns):
        raise ValueError(f"columns {columns}: one distinct name per hook of {hooks}")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir}: not empty; SAELens's cache goes in a new directory")
    context_size = run.seq_len if context_size is None else context_size
    hidden = {h: run.hook(h).hidden for h in hooks}
    features = datasets.Features({
        **{c: datasets.Array2D((context_size, hidden[h]), dtype)
           for h, c in zip(hooks, columns)},
        "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size)})
    limit = None if max_tokens is None else max_tokens // context_size  # whole rows
    written = {"tokens": 0, "dropped": 0, "done": False}

    def unread(batches, it: Iterator, step: int) -> int:
        """Kept tokens the stream would still yield after `step` (its next step), counted
        from its plan where it has one (epochs=1) rather than read; a following stream
        (follow=True) has none and is read through (`it`, its iterator where the export
        stopped), its batches counted and let go."""
        plan = getattr(batches, "plan", None)
        if plan is not None:
            return max(0, plan.tokens_per_epoch - step * plan.batch_size)
        return sum(len(b) for b in it)

    def rows() -> Iterator[dict]:
        pending: list = []  # (acts per hook, ids) pieces not yet in a full row
        have = 0
        with run.stream(hooks, batch_size, seed=seed, epochs=1, drop_last=False,
                        dtype=dtype, **stream_kwargs) as batches:
            step = getattr(batches, "start_step", 0)
            full = limit == 0
            it = iter(batches)
            if not full:
                for b in it:
                    step = b.step + 1
                    pending.append(({h: np.array(b.acts[h]) for h in hooks},
                                    np.array(b.input_ids)))
                    have += len(b)
                    while have >= context_size and not full:
                        acts = {h: np.concatenate([p[0][h] for p in pending]) for h in hooks}
                        ids = np.concatenate([p[1] for p in pending])
                        yield {**{c: acts[h][:context_size] for h, c in zip(hooks, columns)},
                               "token_ids": ids[:context_size].astype(np.int32)}
                        written["tokens"] += context_size
                        pending = [({h: a[context_size:] for h, a in acts.items()},
                                    ids[context_size:])]
                        have -= context_size
                        full = limit is not None and written["tokens"] == limit * context_size
                    if full:
                        break
            # Everything kept and not written: the tail short of a row, and what
            # max_tokens left unread.
            written["dropped"] = have + (unread(batches, it, step) if full else 0)
        written["done"] = True

    cache = tempfile.mkdtemp(prefix="actx-saelens-")
    try:
        try:
            data = datasets.Dataset.from_generator(rows, features=features, cache_dir=cache)
        except Exception:
            if not written["done"] or written["tokens"]:
                raise
            # No row (max_tokens under one row, or fewer kept tokens than a row):
            # from_generator refuses an empty split; an empty dataset saved in one shard
            # loads back (zero shards do not).
            data = datasets.Dataset.from_dict({c: [] for c in features}, features=features)
        data.save_to_disk(out_dir, **({} if len(data) else {"num_shards": 1}))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    d_in = {c: hidden[h] for h, c in zip(hooks, columns)}
    names = {"hook_name": columns[0], "d_in": d_in[columns[0]]} if len(columns) == 1 \
        else {"d_in": d_in}
    return {"hook_names": list(columns), **names, "context_size": context_size,
            "tokens": written["tokens"], "dropped_tokens": written["dropped"],
            "rows": len(data)}
