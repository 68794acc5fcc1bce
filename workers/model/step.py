"""The jitted extraction step: token batch in, requested activations out.

`make_extract_fn` binds a loaded model and a `CaptureSpec` into one jitted function with
explicit in/out shardings on a mesh. It compiles once per input shape, returns exactly the
requested hook arrays ([batch, seq, hidden], batch split over the `data` mesh axis) and
never computes an LM head. Given `max_context`, the step keeps a per-slot KV cache on the
devices between calls (donated, so updated in place), and a slot whose row continues its
previous row attends to that row's document before it (workers.attention.kv_cache). Given an
`output_memory_kind` ("pinned_host"), the executable itself writes its outputs to host memory.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from actx.workers.attention import dispatch as attention
from actx.workers.model import capture as capture_lib
from actx.workers.attention import kv_cache
from actx.workers.model import decoder as model_lib
from actx.workers.model import quantise
from actx.workers.model import sharding


class ExtractFn:
    """Callable `fn(input_ids, positions=None, segment_ids=None, continues=None)
    -> {hook name: array}`.

    input_ids, positions, segment_ids: int32 [batch, seq] (numpy or jax; global jax.Arrays
      on multi-host meshes). positions default to arange(seq) per row; segment ids default
      to 1 everywhere (one document per row, no padding). Segment 0 marks padding.
    continues: bool [batch], only with max_context: the slot's row continues the row it
      ran in the previous call (default: no slot does). The slot's cache holds the
      document that began that row, so only it can continue: its tokens filled that row
      to the end, and this row's first document is it, at the next positions. Host
      (numpy) inputs are checked (`continued_rows`) and a row that breaks this refused;
      device arrays are not (a run's packing makes such rows only).
    max_context: None for rows seen alone; else the cache window (PackingSpec.max_context).
    output_memory_kind: where the outputs land: None for device memory, "pinned_host" for
      the host's pinned memory (the device-to-host copy is part of the executable; only
      with a mesh).
    hook_names: the hooks every call returns, sorted.
    output_names: the keys every call returns, sorted: the hooks, and in a float8 capture
      each float hook's `<hook>.scale` (the step quantises on the device: workers.model.quantise).
    trace_count: how many times the step was traced (1 per distinct input shape).
    """

    def __init__(self, model: model_lib.Model, spec: capture_lib.CaptureSpec,
                 mesh: Mesh | None = None, attention_impl: str | None = None,
                 max_context: int | None = None, output_memory_kind: str | None = None):
        cfg = model.config
        spec.validate(cfg)
        self.spec = spec
        self.config = cfg
        self.mesh = mesh if mesh is not None else model.mesh
        self.hook_names = spec.hook_names(cfg.num_layers, capture_lib.router_layers_of(cfg))
        if not self.hook_names:
            raise ValueError("the capture spec requests no hooks")
        self.trace_count = 0
        point_layers = spec.point_layers(cfg.num_layers, capture_lib.router_layers_of(cfg))
        global_points = spec.global_points()
        self.output_names = quantise.output_names(self.hook_names, spec.dtype)
        out_dtype = quantise.compute_dtype(spec.dtype)
        mesh = self.mesh

        if mesh is None:
            constrain = lambda x, axes: x  # noqa: E731
        else:
            def constrain(x, axes):
                named = sharding.logical_sharding(axes, x.shape, mesh)
                return jax.lax.with_sharding_constraint(x, named)

        self.max_context = max_context
        self.attention_impl = attention_impl
        self._next_positions = None  # per slot, where its row may continue (continued_rows)
        if output_memory_kind is not None and mesh is None:
            raise ValueError("output_memory_kind needs a mesh")
        self.output_memory_kind = output_memory_kind
        data_shards = 1 if mesh is None else sharding.axis_size(mesh, "batch")
        self.layers_run = model_lib.layers_to_run(cfg, point_layers, global_points)
        self._cache: kv_cache.KVCache | None = None
        self._dtype = model.dtype

        def extract(params, input_ids_bt, positions_bt, segment_ids_bt):
            self.trace_count += 1  # Python side effect: runs only when tracing
            outs = model_lib.forward(
                params, cfg, input_ids_bt, positions_bt, segment_ids_bt,
                point_layers=point_layers, global_points=global_points,
                out_dtype=out_dtype, constrain=constrain, attention_impl=attention_impl)
            return quantise.quantise_outputs(outs, spec.dtype)

        def extract_cached(params, input_ids_bt, positions_bt, segment_ids_bt, continues_b,
                           cache):
            self.trace_count += 1
            outs, cache = model_lib.forward_cached(
                params, cfg, input_ids_bt, positions_bt, segment_ids_bt, continues_b, cache,
                max_context=max_context, point_layers=point_layers,
                global_points=global_points, out_dtype=out_dtype, constrain=constrain,
                attention_impl=attention_impl, data_shards=data_shards)
            return quantise.quantise_outputs(outs, spec.dtype), cache

        params = model.params
        self._cache_shardings = None
        self._slot_sharding = None
        if mesh is None:
            self._jitted = jax.jit(extract)
            self._jitted_cached = jax.jit(extract_cached, donate_argnums=(5,))
            self._token_sharding = None
        else:
            param_shardings = jax.tree.map(
                lambda axes, p: sharding.logical_sharding(axes, p.shape, mesh),
                model.param_axes, params, is_leaf=lambda x: isinstance(x, tuple))
            if model.mesh is not mesh:
                # Loaded for another mesh (or none): reshard once, not on every call.
                params = jax.device_put(params, param_shardings)
            self._token_sharding = sharding.data_parallel_sharding(mesh, 2)
            act_sharding = self.out_sharding
            out_shardings = {name: act_sharding for name in self.output_names}
            self._jitted = jax.jit(
                extract,
                in_shardings=(param_shardings, self._token_sharding, self._token_sharding,
                              self._token_sharding),
                out_shardings=out_shardings)
            self._slot_sharding = sharding.data_parallel_sharding(mesh, 1)
            self._param_shardings = param_shardings
            self._out_shardings = out_shardings
            self._extract_cached = extract_cached
            self._jitted_cached = None  # built with the cache's shardings on first use
        self._params = params

    @property
    def token_sharding(self) -> NamedSharding | None:
        """Sharding of every [batch, seq] input (batch over `data`), or None without a mesh."""
        return self._token_sharding

    @property
    def out_sharding(self) -> NamedSharding | None:
        """Sharding of every output (batch over `data`, in `output_memory_kind`), or None
        without a mesh."""
        if self.mesh is None:
            return None
        out = sharding.data_parallel_sharding(self.mesh, 3)
        kind = self.output_memory_kind
        return out if kind is None else out.with_memory_kind(kind)

    def compile_count(self) -> int:
        """Executables jax holds for this step (one per distinct input shape)."""
        cached = self._jitted_cached._cache_size() if self._jitted_cached is not None else 0
        return self._jitted._cache_size() + cached

    @property
    def slot_sharding(self) -> NamedSharding | None:
        """Sharding of per-slot [batch] inputs (`continues`), or None without a mesh."""
        return self._slot_sharding

    def cache_bytes_per_device(self, batch: int, seq_len: int) -> int:
        """Bytes of KV cache each device holds for a global batch of `batch` slots."""
        if self.max_context is None:
            return 0
        capacity = kv_cache.capacity_tokens(self.max_context, seq_len)
        total = kv_cache.cache_bytes(self.config, self.layers_run, batch, capacity,
                                     jnp.dtype(self._dtype).itemsize)
        if self.mesh is None:
            return total
        shards = sharding.axis_size(self.mesh, "batch")
        if self.config.num_kv_heads % sharding.axis_size(self.mesh, "kv_heads") == 0:
            shards *= sharding.axis_size(self.mesh, "kv_heads")
        return total // shards

    def _empty_cache(self, batch: int, seq: int) -> kv_cache.KVCache:
        capacity = kv_cache.capacity_tokens(self.max_context, seq)

        def make():
            return kv_cache.zeros(self.config, self.layers_run, batch, capacity, self._dtype)

        if self.mesh is None:
            return jax.jit(make)()
        shapes = jax.eval_shape(make)
        self._cache_shardings = jax.tree.map(
            lambda axes, leaf: sharding.logical_sharding(axes, leaf.shape, self.mesh),
            kv_cache.logical_axes(), shapes, is_leaf=lambda x: isinstance(x, tuple))
        self._jitted_cached = jax.jit(
            self._extract_cached,
            in_shardings=(self._param_shardings, self._token_sharding, self._token_sharding,
                          self._token_sharding, self._slot_sharding, self._cache_shardings),
            out_shardings=(self._out_shardings, self._cache_shardings),
            donate_argnums=(5,))
        # Made on the devices in its sharding, so every process of a replica holds its part.
        return jax.jit(make, out_shardings=self._cache_shardings)()

    def __call__(self, input_ids, positions=None, segment_ids=None,
                 continues=None) -> dict[str, jax.Array]:
        if len(input_ids.shape) != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        batch, seq = input_ids.shape
        if self.mesh is not None:
            sharding.check_batch(batch, self.mesh)
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and tuple(arr.shape) != (batch, seq):
                raise ValueError(f"{name} shape {tuple(arr.shape)} differs from "
                                 f"input_ids shape {(batch, seq)}")
        check_positions(self.config, positions, seq)
        given = (positions, segment_ids)  # as passed: continued_rows checks host arrays
        if positions is None:
            positions = self._default_tokens(batch, seq, "positions")
        if segment_ids is None:
            segment_ids = self._default_tokens(batch, seq, "segment_ids")
        if self.max_context is None:
            if continues is not None:
                raise ValueError("continues= needs a step made with max_context")
            return self._jitted(self._params, _as_int32(input_ids), _as_int32(positions),
                                _as_int32(segment_ids))
        if continues is None:
            continues = np.zeros((batch,), bool)
        self._next_positions = continued_rows(
            self._next_positions,
            np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
            if given[0] is None else given[0],
            np.ones((batch, seq), np.int32) if given[1] is None else given[1], continues)
        if self._cache is None or self._cache.pos_bc.shape != (
                batch, kv_cache.capacity_tokens(self.max_context, seq)):
            self._cache = self._empty_cache(batch, seq)
        cache, self._cache = self._cache, None  # donated: unusable if the call fails
        outs, self._cache = self._jitted_cached(
            self._params, _as_int32(input_ids), _as_int32(positions), _as_int32(segment_ids),
            continues if isinstance(continues, jax.Array) else np.asarray(continues, bool),
            cache)
        return outs

    def attention_implementation(self, seq_len: int) -> str:
        """The attention implementation the step runs for rows of seq_len tokens (the
        backend's kernel, or the fallback it logged)."""
        return attention.implementation_for(self._dtype, seq_len, self.config.head_dim,
                                            self.config.attn_logit_softcap,
                                            requested=self.attention_impl)

    @functools.lru_cache(maxsize=8)
    def _default_tokens(self, batch: int, seq: int, kind: str) -> jax.Array:
        if kind == "positions":
            host_bt = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq))
        else:
            host_bt = np.ones((batch, seq), np.int32)
        if self._token_sharding is None:
            return jnp.asarray(host_bt)
        # The same global value on every process, so each can fill its own shards.
        return jax.make_array_from_callback((batch, seq), self._token_sharding,
                                            lambda index: host_bt[index])


def continued_rows(expected, positions, segment_ids, continues):
    """Refuses a row flagged as continuing whose slot's cache cannot hold its context:
    the row before it (in the slot) did not end with the document that began it, or this
    row's first document does not carry on at its next position (`expected`: per slot, the
    position the last row's first document would continue at, -1 where it ended inside
    that row; None: not known). Returns this call's `expected` for the next one (None
    where any input is a device array, which is not read back to check)."""
    if any(isinstance(x, jax.Array) for x in (positions, segment_ids, continues)):
        return None
    positions_bt = np.asarray(positions)
    segment_ids_bt = np.asarray(segment_ids)
    continues_b = np.asarray(continues, bool)
    if expected is not None and len(expected) == len(continues_b):
        starts_b = np.where(segment_ids_bt[:, 0] > 0, positions_bt[:, 0], -2)
        bad = np.flatnonzero(continues_b & (starts_b != expected))
        if bad.size:
            b = int(bad[0])
            before = ("its previous row's first document ended inside that row (the only "
                      "document a slot's cache carries to the next row is the one that "
                      "began its row and filled it to the end)" if expected[b] < 0 else
                      f"its previous row's first document continues at position "
                      f"{int(expected[b])}")
            raise ValueError(
                f"continues[{b}]: slot {b}'s row starts with position "
                f"{int(positions_bt[b, 0])} of segment {int(segment_ids_bt[b, 0])}, but "
                f"{before}; a document longer than a row must start a row and fill its "
                f"rows to the end in one slot (as actx's packing puts it), else pass its "
                f"row with continues False")
    ends_b = (segment_ids_bt[:, -1] == segment_ids_bt[:, 0]) & (segment_ids_bt[:, 0] > 0)
    return np.where(ends_b, positions_bt[:, -1] + 1, -1)


def check_positions(cfg, positions, seq: int) -> None:
    """Refuses positions past a model's learned position embeddings (GPT-2's n_positions),
    which have no value there (a lookup would silently clamp). Checked on host arrays;
    a run's rows are bounded before any work (`schemas.position_limits.learned_position_problems`)."""
    if not cfg.learned_positions:
        return
    limit = cfg.max_position_embeddings
    if positions is None:
        highest = seq - 1
    elif isinstance(positions, jax.Array):
        return  # a device array: the run's packing was checked before any step
    else:
        highest = int(np.max(positions)) if np.size(positions) else -1
    if highest >= limit:
        raise ValueError(f"position {highest}: {cfg.architecture}'s learned position "
                         f"embeddings end at n_positions={limit}; pass documents of at "
                         f"most {limit} tokens (packing.overflow: truncate, packing.seq_len "
                         f"<= {limit})")


def _as_int32(x):
    if isinstance(x, jax.Array):
        return x if x.dtype == jnp.int32 else x.astype(jnp.int32)
    return np.asarray(x, dtype=np.int32)


def make_extract_fn(model: model_lib.Model, spec: capture_lib.CaptureSpec,
                    mesh: Mesh | None = None, attention_impl: str | None = None,
                    max_context: int | None = None, output_memory_kind: str | None = None
                    ) -> Callable[..., dict[str, jax.Array]]:
    """The jitted extraction step for `model` and `spec` (see `ExtractFn`).

    mesh: defaults to the mesh the model was loaded on; params are resharded once if
      they were placed elsewhere. attention_impl: one of `attention.IMPLEMENTATIONS`, or
      None for the backend's choice (`attention.implementation_for`).
    max_context: carry a per-slot KV cache of this window between calls.
    output_memory_kind: "pinned_host" to have the outputs written to pinned host memory.
    """
    return ExtractFn(model, spec, mesh, attention_impl, max_context, output_memory_kind)
