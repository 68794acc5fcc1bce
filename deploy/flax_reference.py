"""A user's Flax NNX model as the reference of `actx verify --reference` (`model.flax`): the
module its factory builds, called eagerly (op by op, no jit, no mesh) on one document at
a time, with each hooked submodule's input or output read as it runs.

The workers run the same module jitted and sharded over packed rows; here it sees one
document alone, positions 0..n-1, as its `__call__` takes them (`positions=`,
`segment_ids=` all ones, or a causal `attention_mask=`). A stored hook is
`<module path>:<point>` (README, "Your own Flax model").
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import inspect
import types

import numpy as np

from actx.schemas import errors

_RECORDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "actx_flax_reference", default=None)


class FlaxReferenceError(errors.UserError, ValueError):
    """The Flax model cannot be built or run as the reference."""


@dataclasses.dataclass
class FlaxReference:
    """The built module; dtypes: those of its weights (its compute dtype follows them)."""

    module: object
    described: str
    dtypes: frozenset

    @property
    def compute_dtype(self) -> str:
        return "bfloat16" if self.dtypes & {"bfloat16", "float16"} else "float32"


def load(factory_ref: str) -> FlaxReference:
    """The module `factory_ref` ("package.module:factory") builds, in eval mode."""
    try:
        import flax
        import jax
        from flax import nnx
    except ImportError:
        raise FlaxReferenceError("--reference of a Flax model needs Flax: pip install "
                                 "'actx-lm[flax]'") from None
    module_name, _, attr = factory_ref.partition(":")
    try:
        factory = functools.reduce(getattr, attr.split("."),
                                   importlib.import_module(module_name))
    except (ImportError, AttributeError) as e:
        raise FlaxReferenceError(f"model.flax: {factory_ref}: cannot be loaded here ({e}); "
                                 f"put its package on PYTHONPATH") from None
    with nnx.use_eager_sharding(False):
        made = factory()
    module = made[0] if isinstance(made, tuple) else made
    if hasattr(module, "eval"):
        module.eval()
    dtypes = frozenset(str(x.dtype) for x in jax.tree_util.tree_leaves(nnx.state(module))
                       if hasattr(x, "dtype"))
    return FlaxReference(module, f"{factory_ref} run eagerly (flax {flax.__version__}, jax "
                                 f"{jax.__version__}, {jax.default_backend()})", dtypes)


@functools.lru_cache(maxsize=None)
def _recording(cls: type) -> type:
    """`cls` whose `__call__` records its first positional argument and its result."""

    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        seen = (_RECORDING.get() or {}).get(id(self))
        if seen is not None:
            seen.update(input=args[0] if args else None, output=out)
        return out

    return types.new_class(cls.__name__, (cls,), exec_body=lambda ns: ns.update(
        __call__=__call__, __module__=cls.__module__, __qualname__=cls.__qualname__))


def supports(ref: FlaxReference, hook: str) -> bool:
    from flax import nnx

    path, _, point = hook.rpartition(":")
    paths = {".".join(str(k) for k in p) for p, node in nnx.iter_graph(ref.module)
             if isinstance(node, nnx.Module)}
    return point in ("input", "output") and path in paths


def hooks(ref: FlaxReference, input_ids: np.ndarray, wanted: list[str]
          ) -> dict[str, np.ndarray]:
    """{hook: float32 [n, width]} of one document of ids `input_ids` [n]."""
    import jax.numpy as jnp
    from flax import nnx

    module = ref.module
    nodes = {".".join(str(k) for k in p): node for p, node in nnx.iter_graph(module)
             if isinstance(node, nnx.Module)}
    recording, classes = {}, {}
    for hook in wanted:
        node = nodes[hook.rpartition(":")[0]]
        if id(node) not in recording:
            classes[id(node)] = (node, type(node))
            object.__setattr__(node, "__class__", _recording(type(node)))
            recording[id(node)] = {}
    n = len(input_ids)
    params = inspect.signature(type(module).__call__).parameters
    kwargs = {}
    if "positions" in params:
        kwargs["positions"] = jnp.arange(n, dtype=jnp.int32)[None]
    if "segment_ids" in params:
        kwargs["segment_ids"] = jnp.ones((1, n), jnp.int32)
    elif "attention_mask" in params:
        kwargs["attention_mask"] = jnp.tril(jnp.ones((n, n), bool))[None, None]
    token = _RECORDING.set(recording)
    try:
        module(jnp.asarray(np.asarray(input_ids, np.int32)[None]), **kwargs)
    finally:
        _RECORDING.reset(token)
        for node, cls in classes.values():
            object.__setattr__(node, "__class__", cls)
    out = {}
    for hook in wanted:
        path, _, point = hook.rpartition(":")
        value = recording[id(nodes[path])].get(point)
        if value is None:
            raise FlaxReferenceError(f"hook {hook}: {path} was not called with an array "
                                     f"{point} on a document alone")
        out[hook] = np.asarray(value, np.float32).reshape(n, -1)
    return out
