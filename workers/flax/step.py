"""The jitted step for a user's Flax NNX model: token batch in, the hooked submodules'
inputs and outputs out.

Inside one jitted function the model is merged from its weights, the submodules a hook
names are switched to a subclass whose `__call__` records its first positional argument
and its result, and the model is called once. Only the recorded arrays leave the function,
so XLA drops the work nothing hooked depends on (the layers after the last hook, any LM
head). The step has the interface of `workers.model.step.ExtractFn`, so the worker loop, its
transfers and writers run it unchanged.
"""

from __future__ import annotations

import contextvars
import functools
import types
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from actx.workers.flax import hooks as flax_hooks, model as flax_model
from actx.workers.model import quantise
from actx.workers.model import sharding

# The recording of the trace in progress: {id(submodule): {"input": x, "output": y}}.
_RECORDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("actx_flax_rec",
                                                                         default=None)


@functools.lru_cache(maxsize=None)
def _recording_class(cls: type) -> type:
    """`cls` with a `__call__` that records what the call got and gave while a step traces."""

    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        recording = _RECORDING.get()
        if recording is not None and id(self) in recording:
            seen = recording[id(self)]
            if "output" in seen:
                raise ValueError(f"{seen['path']} is called more than once in one forward "
                                 f"pass: its hook would be ambiguous; hook a submodule that "
                                 f"runs once")
            seen.update(input=args[0] if args else None, output=out)
        return out

    return types.new_class(cls.__name__, (cls,), exec_body=lambda ns: ns.update(
        __call__=__call__, __module__=cls.__module__, __qualname__=cls.__qualname__))


def attention_mask(segment_ids_bt: jax.Array) -> jax.Array:
    """bool [b, 1, t, t]: causal within a segment; padding (0) attends earlier padding, so
    no query row is empty."""
    t = segment_ids_bt.shape[1]
    causal_tt = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    same_bts = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return (causal_tt[None] & same_bts)[:, None]


class FlaxExtractFn:
    """Callable `fn(input_ids, positions=None, segment_ids=None) -> {hook name: array}`,
    each array [batch, seq, width] in `dtype`, batch split over the `data` mesh axis.

    Inputs as `workers.model.step.ExtractFn` takes them; what the model does not take is not
    passed. hook_names: the keys every call returns, sorted. trace_count: traces so far.
    """

    max_context = None  # no KV cache: a Flax model sees each row alone

    def __init__(self, model: flax_model.FlaxModel, hooks: Sequence[flax_hooks.FlaxHook],
                 mesh: Mesh | None = None, dtype: str = "float32"):
        from flax import nnx

        if not hooks:
            raise ValueError("no hooks to capture")
        self.model, self.hooks, self.mesh = model, tuple(hooks), mesh
        self.hook_names = sorted(h.name for h in self.hooks)
        # A float8 capture adds each hook's scales, quantised here on the device.
        self.output_names = quantise.output_names(self.hook_names, dtype)
        self.trace_count = 0
        out_dtype = quantise.compute_dtype(dtype)
        call = model.call
        hooked_paths = sorted({h.path for h in self.hooks})

        def extract(state, input_ids_bt, positions_bt, segment_ids_bt):
            self.trace_count += 1  # Python side effect: runs only when tracing
            module = nnx.merge(model.graphdef, state)
            if hasattr(module, "eval"):
                module.eval()  # dropout off, batch statistics frozen, on this copy only
            nodes = {".".join(str(k) for k in path): node
                     for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Module)}
            recording = {}
            for path in hooked_paths:
                node = nodes[path]
                object.__setattr__(node, "__class__", _recording_class(type(node)))
                recording[id(node)] = {"path": path}
            kwargs = {}
            if call.positions:
                kwargs["positions"] = positions_bt
            if call.mask == "segment_ids":
                kwargs["segment_ids"] = segment_ids_bt
            elif call.mask == "attention_mask":
                kwargs["attention_mask"] = attention_mask(segment_ids_bt)
            token = _RECORDING.set(recording)
            # What the model sows is collected by flax's own capture and dropped.
            run = nnx.capture(module, nnx.Intermediate) if hasattr(nnx, "capture") else module
            try:
                run(input_ids_bt, **kwargs)
            finally:
                _RECORDING.reset(token)
            b, t = input_ids_bt.shape
            outs = {}
            for hook in self.hooks:
                seen = recording[id(nodes[hook.path])]
                outs[hook.name] = _as_activation(seen.get(hook.point), hook, "output" in seen, b, t,
                                                 out_dtype)
            return quantise.quantise_outputs(outs, dtype)

        self._extract = extract
        if mesh is None:
            self._jitted = jax.jit(extract)
            self._token_sharding = None
        else:
            self._token_sharding = sharding.data_parallel_sharding(mesh, 2)
            act = sharding.data_parallel_sharding(mesh, 3)
            self._jitted = jax.jit(
                extract,
                in_shardings=(model.state_shardings, self._token_sharding,
                              self._token_sharding, self._token_sharding),
                out_shardings={name: act for name in self.output_names})

    @property
    def token_sharding(self) -> NamedSharding | None:
        return self._token_sharding

    @property
    def out_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else sharding.data_parallel_sharding(self.mesh, 3)

    slot_sharding = None  # no per-slot inputs: nothing is carried between calls

    def compile_count(self) -> int:
        return self._jitted._cache_size()

    def hook_widths(self, seq_len: int) -> dict[str, int]:
        """{hook name: width} of rows of `seq_len` tokens (traced abstractly, not run)."""
        batch = 1 if self.mesh is None else sharding.axis_size(self.mesh, "batch")
        tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
        traces = self.trace_count
        shapes = jax.eval_shape(self._extract, self.model.state, tokens, tokens, tokens)
        self.trace_count = traces  # an abstract trace, not one of the step's
        return {name: int(shape.shape[-1]) for name, shape in shapes.items()}

    def __call__(self, input_ids, positions=None, segment_ids=None,
                 continues=None) -> dict[str, jax.Array]:
        if continues is not None:
            raise ValueError("a Flax model carries nothing between calls (continues=)")
        if len(input_ids.shape) != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        batch, seq = input_ids.shape
        if self.mesh is not None:
            sharding.check_batch(batch, self.mesh)
        if positions is None:
            positions = self._default_tokens(batch, seq, "positions")
        if segment_ids is None:
            segment_ids = self._default_tokens(batch, seq, "segment_ids")
        return self._jitted(self.model.state, _as_int32(input_ids), _as_int32(positions),
                            _as_int32(segment_ids))

    @functools.lru_cache(maxsize=8)
    def _default_tokens(self, batch: int, seq: int, kind: str) -> jax.Array:
        host_bt = (np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
                   if kind == "positions" else np.ones((batch, seq), np.int32))
        if self._token_sharding is None:
            return jnp.asarray(host_bt)
        return jax.make_array_from_callback((batch, seq), self._token_sharding,
                                            lambda index: host_bt[index])


def _as_activation(x, hook: flax_hooks.FlaxHook, called: bool, b: int, t: int,
                   out_dtype) -> jax.Array:
    """The recorded array as [b, t, width] in `out_dtype`, or a clear error."""
    if not called:
        raise ValueError(f"hook {hook.name}: {hook.path} was not called in the forward pass; "
                         f"hook a submodule the model's __call__ runs")
    if not isinstance(x, jax.Array):
        what = "no positional argument" if x is None else type(x).__name__
        raise ValueError(f"hook {hook.name}: {hook.path} {hook.point} is {what}, not an "
                         f"array; hook the submodule whose {hook.point} is one [batch, seq, "
                         f"...] array")
    if x.ndim < 2 or x.shape[:2] != (b, t):
        raise ValueError(f"hook {hook.name}: shape {tuple(x.shape)} does not start with "
                         f"[batch, seq] = [{b}, {t}]")
    return x.reshape(b, t, -1).astype(out_dtype)


def _as_int32(x):
    if isinstance(x, jax.Array):
        return x if x.dtype == jnp.int32 else x.astype(jnp.int32)
    return np.asarray(x, dtype=np.int32)


def make_flax_extract_fn(model, hooks: str | Sequence[str], mesh: Mesh | None = None,
                         dtype: str = "float32") -> FlaxExtractFn:
    """The jitted step for a user's Flax NNX model (from Python: the module itself).

    model: an `nnx.Module` (its weights are placed on `mesh` by their annotations) or a
      loaded `flax_model.FlaxModel`. hooks: "blocks.*:output,blocks.0.attn:input".
    """
    if not isinstance(model, flax_model.FlaxModel):
        model = flax_model.load(model, mesh)
    return FlaxExtractFn(model, flax_hooks.parse_hooks(hooks, model.paths), mesh, dtype)
