"""Meshes on 8 CPU devices give the single-device activations; divisibility fallbacks."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from tests import hf_models
from actx.workers.model import capture, sharding, step
from actx.workers.model import decoder as model_lib

HOOKS = "layers.0.attn_out,layers.1.mlp_out,layers.*.resid_post,embed,final_norm"
BATCH, SEQ = 8, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    # 8 heads and 4 kv heads: kv heads split over model<=4 and fall back to replication
    # at model=8; MLP width 128 and vocab 512 split every way.
    return hf_models.make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen2_8h"), "qwen2", num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.RandomState(0)
    ids = rng.randint(1, 512, (BATCH, SEQ)).astype(np.int32)
    seg = np.ones((BATCH, SEQ), np.int32)
    seg[:, 10:] = 2
    seg[3, 12:] = 0
    pos = np.where(seg == 2, np.arange(SEQ) - 10, np.arange(SEQ)).astype(np.int32)
    return ids, pos, seg


@pytest.fixture(scope="module")
def single_device(ckpt, inputs):
    model = model_lib.load_pretrained(ckpt)
    out = step.make_extract_fn(model, capture.CaptureSpec.parse(HOOKS))(*inputs)
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("data,model_size", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_meshes_match_single_device(ckpt, inputs, single_device, data, model_size):
    mesh = sharding.make_mesh(data=data, model=model_size)
    model = model_lib.load_pretrained(ckpt, mesh=mesh)
    q_weight = model.params["layers"]["q_weight_ldnh"]
    assert q_weight.sharding.spec == PartitionSpec(None, None, "model", None)
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(HOOKS))
    out = fn(*inputs)
    assert sorted(out) == sorted(single_device)
    for name, ref in single_device.items():
        assert out[name].sharding.spec == PartitionSpec("data", None, None), name
        err = np.max(np.abs(np.asarray(out[name]) - ref)) / np.max(np.abs(ref))
        assert err <= 1e-6, (name, err)


def test_indivisible_kv_heads_are_replicated_and_logged(ckpt, caplog):
    mesh = sharding.make_mesh(data=1, model=8)
    with caplog.at_level(logging.INFO, logger="actx.workers.model.sharding"):
        model = model_lib.load_pretrained(ckpt, mesh=mesh)
    assert model.params["layers"]["k_weight_ldkh"].sharding.spec == PartitionSpec(
        None, None, None, None)
    assert "k_weight_ldkh: kv_heads dim 4 not divisible by mesh axis model=8" in caplog.text


def test_model_loaded_without_mesh_is_resharded(ckpt, inputs, single_device):
    mesh = sharding.make_mesh(data=4, model=2)
    fn = step.make_extract_fn(model_lib.load_pretrained(ckpt), capture.CaptureSpec.parse(
        "final_norm"), mesh=mesh)
    np.testing.assert_allclose(fn(*inputs)["final_norm"], single_device["final_norm"],
                               rtol=1e-6, atol=1e-6)


def test_batch_not_divisible_by_data_axis(ckpt, inputs):
    mesh = sharding.make_mesh(data=4, model=2)
    fn = step.make_extract_fn(model_lib.load_pretrained(ckpt, mesh=mesh),
                              capture.CaptureSpec.parse("final_norm"))
    with pytest.raises(ValueError, match=r"batch size 6 .* 'data' mesh axis size 4"):
        fn(inputs[0][:6])


def test_make_mesh_shapes_and_errors():
    assert dict(sharding.make_mesh(model=2).shape) == {"data": 4, "model": 2}
    assert dict(sharding.make_mesh(2, 2, devices=jax.devices()[:4]).shape) == {
        "data": 2, "model": 2}
    with pytest.raises(ValueError, match="model axis size 3 does not divide the 8 devices"):
        sharding.make_mesh(model=3)
    with pytest.raises(ValueError, match="2 x model=2 = 4 devices, but 8"):
        sharding.make_mesh(data=2, model=2)


def test_logical_spec_table():
    mesh = sharding.make_mesh(data=2, model=4)
    assert sharding.logical_spec(("batch", "seq", "embed"), (4, 16, 64), mesh) == \
        PartitionSpec("data", None, None)
    assert sharding.logical_spec(("layers", "embed", "mlp"), (2, 64, 6), mesh) == \
        PartitionSpec(None, None, None)  # 6 % 4: replicated
    with pytest.raises(ValueError, match="batch size 3 is not divisible"):
        sharding.logical_spec(("batch", "seq"), (3, 16), mesh)
