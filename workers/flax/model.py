"""A user's Flax NNX model as actx runs it: loaded from a factory, what its `__call__`
takes, which packing modes it can therefore serve, and its weights on actx's mesh.

The model's `__call__(input_ids, ...)` takes int32 token ids [batch, seq] and, where it
supports them, keyword arguments `positions` (int32 [batch, seq], the position inside the
document) and `segment_ids` (int32 [batch, seq], 0 = padding, 1.. = document within the
row) or `attention_mask` (bool [batch, 1, seq, seq], query may attend key). Without a
segment or attention mask a row must hold one document from its first column: `pad` with
`overflow: truncate`. No Flax model carries a document across rows (`overflow: continue`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

import numpy as np

from actx.schemas import errors
from actx.schemas import runspec as runspec_lib

MASK_ARGS = ("segment_ids", "attention_mask")


@dataclasses.dataclass(frozen=True)
class CallSignature:
    """What the model's `__call__` accepts besides token ids.

    positions: it takes `positions=`. mask: "segment_ids", "attention_mask" or None.
    shown: the signature as the user wrote it, for messages.
    """

    positions: bool
    mask: str | None
    shown: str

    @classmethod
    def of(cls, module) -> "CallSignature":
        sig = inspect.signature(type(module).__call__)
        params = sig.parameters
        mask = next((name for name in MASK_ARGS if name in params), None)
        return cls("positions" in params, mask, f"{type(module).__name__}.__call__{sig}")


def packing_problem(packing: runspec_lib.PackingSpec, call: CallSignature,
                    factory: str) -> str | None:
    """Why the model cannot serve `packing`, in one line naming what to use; None if it can."""
    where = f"the Flax model {factory} ({call.shown})"
    if packing.mode != "concat" and packing.overflow == "continue":
        return (f'packing.overflow="continue": {where} cannot carry a document\'s context '
                f'across rows (actx\'s KV cache is for its own decoder); prepare with '
                f'packing.overflow="truncate"')
    if packing.mode == "pad":
        return None
    if call.mask is None:
        return (f'packing.mode="{packing.mode}": {where} takes no segment_ids or '
                f'attention_mask, so several documents in a row would see each other; '
                f'use packing.mode="pad" with packing.overflow="truncate" (one document per '
                f'row), or give __call__ a segment_ids= or attention_mask= argument')
    if packing.mode == "segmented" and not call.positions:
        return (f'packing.mode="segmented": {where} takes no positions, so a row\'s later '
                f'documents would not start at position 0; give __call__ a positions= '
                f'argument, or use packing.mode="pad" or "concat"')
    return None


def load_factory(ref: str) -> Callable[[], Any]:
    """The callable named by "package.module:factory", with a clear error if it is not."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model.flax: cannot import {module_name!r} ({e}); install the "
                         f"package or put it on PYTHONPATH on every host") from e
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"model.flax: {module_name} has no {attr!r}")
    if not callable(factory):
        raise ValueError(f"model.flax: {ref} is not callable")
    return factory


class FlaxMissing(errors.UserError):
    """model.flax is used where Flax is not installed."""


def import_nnx():
    """flax.nnx, or a one-line error saying what to install."""
    try:
        from flax import nnx
    except ImportError as e:
        raise FlaxMissing(f"model.flax needs Flax, which is not installed here ({e}); "
                          f"pip install 'actx-lm[flax]' on every host that extracts") from e
    return nnx


def build(ref_or_factory, abstract: bool = False) -> tuple[Any, str | None]:
    """(module, tokenizer path or None): what the factory returns, the module alone or
    `(module, tokenizer_path)`. Annotations stay metadata (no eager sharding): actx places
    the weights itself on its own mesh. abstract: shapes only (nnx.eval_shape), for
    pre-flight checks that must not allocate the weights."""
    nnx = import_nnx()

    factory = load_factory(ref_or_factory) if isinstance(ref_or_factory, str) else ref_or_factory
    tokenizer: list[str] = []

    def module_only():
        made = factory()
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], str):
            made, path = made
            tokenizer.append(path)
        return made

    with nnx.use_eager_sharding(False):
        module = nnx.eval_shape(module_only) if abstract else module_only()
    if not isinstance(module, nnx.Module):
        raise ValueError(f"model.flax: {ref_or_factory} returned a {type(module).__name__}, "
                         f"not a flax.nnx.Module (or a (module, tokenizer path) pair)")
    return module, (tokenizer[0] if tokenizer else None)


def module_paths(module) -> list[str]:
    """Dotted paths of every submodule ("blocks.0.mlp"), root excluded."""
    from flax import nnx

    return sorted(".".join(str(k) for k in path) for path, node in nnx.iter_graph(module)
                  if isinstance(node, nnx.Module) and path)


def vocab_size(module) -> int | None:
    """Rows of the model's first nnx.Embed (in graph order), or None if it has none."""
    from flax import nnx

    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Embed):
            return int(node.num_embeddings)
    return None


@dataclasses.dataclass(frozen=True)
class FlaxModel:
    """A user's model, split for jit: `graphdef` (structure) and `state` (weights, placed
    on `mesh` by their annotations, or on the default device without a mesh).

    paths: its submodule paths. call: what `__call__` accepts. vocab_size: rows of its
    first nnx.Embed, or None. digest: crc32c over every weight's path, dtype, shape and
    bytes (the identity of the weights, recorded with the run). name: the factory, or the
    module's class.
    """

    graphdef: Any
    state: Any
    state_shardings: Any
    paths: tuple[str, ...]
    call: CallSignature
    vocab_size: int | None
    digest: str
    name: str
    mesh: Any = None


def load(ref_or_module, mesh=None) -> FlaxModel:
    """Builds (from "package.module:factory") or takes a module, and places its weights.

    mesh: an actx (data, model) mesh; each weight is sharded by its own annotation
    (`nnx.with_partitioning`, see `workers.model.sharding.annotation_spec`), else replicated.
    """
    import jax

    from actx.workers.model import sharding

    nnx = import_nnx()
    if isinstance(ref_or_module, str):
        (module, _), name = build(ref_or_module), ref_or_module
    else:
        module, name = ref_or_module, type(ref_or_module).__name__
    graphdef, state = nnx.split(module)
    host_state = jax.tree.map(np.asarray, state)
    digest = _digest(host_state)
    specs = nnx.get_partition_spec(state)
    if mesh is None:
        shardings = None
        placed = jax.tree.map(jax.numpy.asarray, host_state)
    else:
        flat_specs = dict(_flat(specs))
        shardings = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.sharding.NamedSharding(mesh, sharding.annotation_spec(
                tuple(flat_specs.get(_key(path)) or ()), leaf.shape, mesh, _key(path))),
            host_state)
        # From the same host value on every process, so each fills its own shards.
        placed = jax.tree.map(
            lambda leaf, s: jax.make_array_from_callback(leaf.shape, s, lambda i: leaf[i]),
            host_state, shardings)
    return FlaxModel(graphdef, placed, shardings, tuple(module_paths(module)),
                     CallSignature.of(module), vocab_size(module), digest, name, mesh)


def _key(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def _flat(tree):
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    return [(_key(path), leaf) for path, leaf in leaves]


def _digest(host_state) -> str:
    import crc32c

    crc = 0
    for key, leaf in sorted(_flat(host_state)):
        arr = np.ascontiguousarray(leaf)
        crc = crc32c.crc32c(f"{key}:{arr.dtype}:{arr.shape}".encode(), crc)
        crc = crc32c.crc32c(arr.tobytes(), crc)
    return f"flax-crc32c:{crc:08x}"
