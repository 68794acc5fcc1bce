"""The jitted extraction step: compiles once, returns exactly the requested hooks."""

from __future__ import annotations

import numpy as np
import pytest

from tests import hf_models
from actx.workers.model import capture, step
from actx.workers.model import decoder as model_lib


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="module")
def model(ckpt):
    return model_lib.load_pretrained(ckpt)


def _ids(batch, seq, seed=0):
    return np.random.RandomState(seed).randint(1, 512, (batch, seq)).astype(np.int32)


def test_compiles_once_for_many_batches(model):
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse("layers.1.resid_post"))
    for seed in range(6):
        out = fn(_ids(2, 16, seed))
        out["layers.1.resid_post"].block_until_ready()
    assert fn.trace_count == 1 and fn.compile_count() == 1
    fn(_ids(2, 32))  # a new shape is a new program
    assert fn.trace_count == 2 and fn.compile_count() == 2


def test_returns_exactly_the_requested_hooks(ckpt, model):
    spec = capture.CaptureSpec.parse("layers.0.attn_out,layers.1.resid_post,embed",
                                     dtype="float16")
    fn = step.make_extract_fn(model, spec)
    ids = _ids(2, 16)
    out = fn(ids)
    assert sorted(out) == fn.hook_names == ["embed", "layers.0.attn_out",
                                            "layers.1.resid_post"]
    ref = hf_models.hf_hooks(hf_models.load_hf_model(ckpt), ids)
    for name, acts in out.items():
        assert acts.shape == (2, 16, 64) and str(acts.dtype) == "float16"
        # The scan stopped after layer 1 of 3; values still match HF.
        np.testing.assert_allclose(np.asarray(acts, np.float32), ref[name],
                                   rtol=2e-3, atol=2e-3 * np.abs(ref[name]).max())


def test_last_layer_resid_post_is_before_final_norm(ckpt, model):
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse("layers.2.resid_post,"
                                                               "final_norm"))
    ids = _ids(1, 16)
    out = fn(ids)
    ref = hf_models.hf_hooks(hf_models.load_hf_model(ckpt), ids)
    hf_hidden_last = ref["final_norm"]  # HF hidden_states[-1] is after the final norm
    np.testing.assert_allclose(out["final_norm"], hf_hidden_last, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out["layers.2.resid_post"], hf_hidden_last, atol=1e-2)


def test_padding_rows_are_finite_and_do_not_touch_real_rows(model):
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse("layers.*.resid_post"))
    ids = _ids(2, 16)
    seg = np.ones((2, 16), np.int32)
    seg[1] = 0  # a whole padding row
    padded = fn(ids, segment_ids=seg)
    plain = fn(ids)
    for name in padded:
        assert np.isfinite(np.asarray(padded[name])).all()
        np.testing.assert_array_equal(padded[name][0], plain[name][0])


def test_bad_inputs(model):
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse("final_norm"))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        fn(np.zeros((16,), np.int32))
    with pytest.raises(ValueError, match="positions shape"):
        fn(_ids(2, 16), positions=np.zeros((2, 8), np.int32))
    with pytest.raises(ValueError, match="out of range"):
        step.make_extract_fn(model, capture.CaptureSpec.parse("layers.3.resid_post"))
    with pytest.raises(ValueError, match="requests no hooks"):
        step.make_extract_fn(model, capture.CaptureSpec(hooks=()))


@pytest.mark.parametrize("hooks,layers_run", [("layers.0.resid_post", 1),
                                              ("layers.1.resid_post,layers.0.mlp_out", 2),
                                              ("final_norm", 3)])
def test_scan_stops_after_last_requested_layer(model, hooks, layers_run):
    import re

    import jax

    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(hooks))
    ids = _ids(2, 16)
    jaxpr = str(jax.make_jaxpr(fn._jitted)(fn._params, ids, ids, ids))
    assert re.findall(r"length=(\d+)", jaxpr) == [str(layers_run)]


@pytest.mark.parametrize("max_context", [None, 32])
def test_outputs_written_to_pinned_host_memory_by_the_step(model, max_context):
    """The worker asks for pinned host outputs where the backend has them (GPU, TPU); the
    mechanism is the same on the CPU's pinned_host memory kind: the executable places the
    outputs there, with the bytes of outputs left in device memory."""
    from actx.workers.loop import transfer
    from actx.workers.model import sharding

    mesh = sharding.make_mesh(data=-1, model=1)
    spec = capture.CaptureSpec.parse("layers.0.resid_post,final_norm")
    on_device = step.make_extract_fn(model, spec, mesh, max_context=max_context)
    on_host = step.make_extract_fn(model, spec, mesh, max_context=max_context,
                                   output_memory_kind="pinned_host")
    ids = _ids(8, 16)
    want = on_device(ids)
    got = on_host(ids)
    for name in want:
        assert got[name].sharding.memory_kind == "pinned_host"
        assert want[name].sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
        pieces = transfer.host_local_pieces(got[name])
        np.testing.assert_array_equal(np.concatenate([p for _, p in pieces]),
                                      np.asarray(want[name]))
    # The worker leaves the CPU's outputs in place: there they are in host memory already.
    import jax

    assert transfer.output_memory_kind(jax) is None


@pytest.mark.parametrize("platform,kinds,output,copy", [
    ("gpu", {"device", "pinned_host"}, None, "pinned_host"),  # measured fastest (issue 49)
    ("tpu", {"device", "pinned_host"}, "pinned_host", None),
    ("cpu", {"device", "pinned_host"}, None, None),  # device memory is host memory
    ("gpu", {"device"}, None, None),  # no pinned kind: jax's own async copy
])
def test_auto_output_memory_per_backend(monkeypatch, platform, kinds, output, copy):
    """Where "auto" puts a step's outputs on each backend: what the step's executable
    writes to (output_memory_kind) and where the loop copies them after it (copy)."""
    import types

    from actx.workers.loop import transfer

    device = types.SimpleNamespace(platform=platform, addressable_memories=lambda: [
        types.SimpleNamespace(kind=k) for k in sorted(kinds)])
    fake_jax = types.SimpleNamespace(local_devices=lambda: [device])
    monkeypatch.setattr(transfer, "OUTPUT_MEMORY", "auto")
    assert transfer.output_memory_kind(fake_jax) == output
    assert transfer.copy_memory_kind(fake_jax) == copy
