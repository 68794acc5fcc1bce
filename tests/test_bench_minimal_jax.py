"""bench/minimal_jax.py, the baseline issue 49 reports actx against, computes what HF
transformers computes: a ceiling measured on a wrong model would flatter or shame actx."""

import numpy as np
import pytest

from bench import minimal_jax
from tests import hf_models


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_models.make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen2"), "qwen2", hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256)


def test_hidden_states_equal_hf(checkpoint):
    import jax
    import torch

    ids = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)
    hf = hf_models.load_hf_model(checkpoint)
    with torch.no_grad():
        want = hf.model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                        output_hidden_states=True).hidden_states
    params, config = minimal_jax.load_params(checkpoint, "float32")
    layers = [2, 0, 1]
    fn, _ = minimal_jax.jitted(config, layers)
    got = fn(params, jax.numpy.asarray(ids))
    for layer, x in zip(layers, got):
        if layer == config["num_hidden_layers"] - 1:  # HF's last is after the final norm
            x = minimal_jax.final_norm(params, config, x)
        np.testing.assert_allclose(np.asarray(x), want[layer + 1].numpy(), rtol=1e-5,
                                   atol=1e-5)

