"""The jitted extraction step: token batch in, requested activations out.

`make_extract_fn` binds a loaded model and a `CaptureSpec` into one jitted function with
explicit in/out shardings on a mesh. It compiles once per input shape, returns exactly the
requested hook arrays ([batch, seq, hidden], batch split over the `data` mesh axis) and
never computes an LM head.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from workers import capture as capture_lib
from workers import model as model_lib
from workers import sharding


class ExtractFn:
    """Callable `fn(input_ids, positions=None, segment_ids=None) -> {hook name: array}`.

    input_ids, positions, segment_ids: int32 [batch, seq] (numpy or jax; global jax.Arrays
      on multi-host meshes). positions default to arange(seq) per row; segment ids default
      to 1 everywhere (one document per row, no padding). Segment 0 marks padding.
    hook_names: the keys every call returns, sorted.
    trace_count: how many times the step was traced (1 per distinct input shape).
    """

    def __init__(self, model: model_lib.Model, spec: capture_lib.CaptureSpec,
                 mesh: Mesh | None = None, attention_impl: str | None = None):
        cfg = model.config
        spec.validate(cfg)
        self.spec = spec
        self.config = cfg
        self.mesh = mesh if mesh is not None else model.mesh
        self.hook_names = spec.hook_names(cfg.num_layers)
        if not self.hook_names:
            raise ValueError("the capture spec requests no hooks")
        self.trace_count = 0
        point_layers = spec.point_layers(cfg.num_layers)
        global_points = spec.global_points()
        out_dtype = jnp.dtype(spec.dtype)
        mesh = self.mesh

        if mesh is None:
            constrain = lambda x, axes: x  # noqa: E731
        else:
            def constrain(x, axes):
                named = sharding.logical_sharding(axes, x.shape, mesh)
                return jax.lax.with_sharding_constraint(x, named)

        def extract(params, input_ids_bt, positions_bt, segment_ids_bt):
            self.trace_count += 1  # Python side effect: runs only when tracing
            return model_lib.forward(
                params, cfg, input_ids_bt, positions_bt, segment_ids_bt,
                point_layers=point_layers, global_points=global_points,
                out_dtype=out_dtype, constrain=constrain, attention_impl=attention_impl)

        params = model.params
        if mesh is None:
            self._jitted = jax.jit(extract)
            self._token_sharding = None
        else:
            param_shardings = jax.tree.map(
                lambda axes, p: sharding.logical_sharding(axes, p.shape, mesh),
                model.param_axes, params, is_leaf=lambda x: isinstance(x, tuple))
            if model.mesh is not mesh:
                # Loaded for another mesh (or none): reshard once, not on every call.
                params = jax.device_put(params, param_shardings)
            self._token_sharding = sharding.data_parallel_sharding(mesh, 2)
            act_sharding = sharding.data_parallel_sharding(mesh, 3)
            self._jitted = jax.jit(
                extract,
                in_shardings=(param_shardings, self._token_sharding, self._token_sharding,
                              self._token_sharding),
                out_shardings={name: act_sharding for name in self.hook_names})
        self._params = params

    @property
    def out_sharding(self) -> NamedSharding | None:
        """Sharding of every output (batch over `data`), or None without a mesh."""
        return None if self.mesh is None else sharding.data_parallel_sharding(self.mesh, 3)

    def compile_count(self) -> int:
        """Executables jax holds for this step (one per distinct input shape)."""
        return self._jitted._cache_size()

    def __call__(self, input_ids, positions=None, segment_ids=None) -> dict[str, jax.Array]:
        if len(input_ids.shape) != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        batch, seq = input_ids.shape
        if self.mesh is not None:
            sharding.check_batch(batch, self.mesh)
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and tuple(arr.shape) != (batch, seq):
                raise ValueError(f"{name} shape {tuple(arr.shape)} differs from "
                                 f"input_ids shape {(batch, seq)}")
        if positions is None:
            positions = self._default_tokens(batch, seq, "positions")
        if segment_ids is None:
            segment_ids = self._default_tokens(batch, seq, "segment_ids")
        return self._jitted(self._params, _as_int32(input_ids), _as_int32(positions),
                            _as_int32(segment_ids))

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


def _as_int32(x):
    if isinstance(x, jax.Array):
        return x if x.dtype == jnp.int32 else x.astype(jnp.int32)
    return np.asarray(x, dtype=np.int32)


def make_extract_fn(model: model_lib.Model, spec: capture_lib.CaptureSpec,
                    mesh: Mesh | None = None,
                    attention_impl: str | None = None) -> Callable[..., dict[str, jax.Array]]:
    """The jitted extraction step for `model` and `spec` (see `ExtractFn`).

    mesh: defaults to the mesh the model was loaded on; params are resharded once if
      they were placed elsewhere. attention_impl: "xla", "cudnn" or None (automatic).
    """
    return ExtractFn(model, spec, mesh, attention_impl)
