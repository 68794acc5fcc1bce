"""The Pallas kernel of generating steps (workers.attention.decode_flash), in interpret mode on the
CPU: equal to the XLA attention it replaces (`generate_step._attention`) over windows,
soft-caps, query groups, padded rows and many key tiles, and a Generator running it gives
HF `generate`'s greedy ids and HF's forward for every stored activation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actx.workers.attention import decode_flash
from actx.workers.generate import config as generate_config, step as generate_step
from tests import hf_models
from tests.test_generate import (HOOKS, MAX_NEW, _compare_activations, _generator,
                                 _hf_greedy, _prompts)


@pytest.mark.parametrize("b, t, n, k, h, capacity, window, softcap", [
    (3, 1, 4, 2, 16, 40, 2**30, None),     # decode: one query a slot, groups of 2
    (2, 8, 6, 3, 8, 300, 37, None),        # a prefill chunk, a window, 3 key tiles
    (2, 5, 2, 1, 16, 130, 2**30, 30.0),    # soft-capped logits, a capacity not of tiles
    (1, 3, 8, 8, 4, 64, 5, None),          # no grouping, a window shorter than the chunk
    (2, 64, 14, 2, 16, 320, 2**30, None),  # a prefill chunk of 64 in groups of 7: 448
                                           # rows, 4 tiles of 128 (Qwen2.5-0.5B's heads)
])
def test_the_kernel_is_the_xla_attention(b, t, n, k, h, capacity, window, softcap,
                                         monkeypatch):
    monkeypatch.setattr(decode_flash, "KEY_TILE", 32)  # many key tiles, some skipped
    rng = np.random.default_rng(b * 100 + t)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, capacity, k, h)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, capacity, k, h)), jnp.float32)
    start = jnp.asarray(rng.integers(0, capacity - t, b), jnp.int32)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)
    want = generate_step._attention(q, keys, values, positions, window, h ** -0.5, softcap)
    got = decode_flash.attention(q, keys, values, positions, window, scale=h ** -0.5,
                                 softcap=softcap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])  # plain; soft-caps and windows
def test_a_generator_on_the_kernel_equals_hf(arch, tmp_path, monkeypatch):
    monkeypatch.setattr(decode_flash, "KEY_TILE", 16)
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch)
    hf = hf_models.load_hf_model(path)
    prompts = _prompts()
    config = generate_config.GenerateConfig(max_new_tokens=MAX_NEW)
    generator = _generator(path, config, HOOKS, attention="pallas")
    assert generator.attention == "pallas"
    for s, prompt in zip(generator.run(prompts), prompts):
        np.testing.assert_array_equal(s.generated_ids, _hf_greedy(hf, prompt, MAX_NEW, ()))
        _compare_activations(s, hf)


def test_row_tiles_are_powers_of_two_triton_can_lower():
    # Triton's lowering refuses any block whose size is not a power of two (on the H200, a
    # prefill chunk of 448 rows in one block failed to compile); its dot wants 16 rows.
    for rows in (1, 2, 7, 16, 17, 100, 128, 129, 448, 4096):
        tile = decode_flash.row_tile(rows)
        assert tile & (tile - 1) == 0 and 16 <= tile <= 128, (rows, tile)
        assert tile >= min(rows, 128)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's default")
def test_off_an_accelerator_the_default_is_xla():
    class Config:  # the fields attention_for reads of a ModelConfig
        num_heads, num_kv_heads, head_dim, attn_logit_softcap = 4, 2, 16, None
        attention_sinks = False

    assert generate_step.attention_for(jnp.bfloat16, Config, 64) == "xla"
    assert generate_step.attention_for(jnp.float32, Config, 64, "pallas") == "pallas"
    with pytest.raises(ValueError, match="choose one of xla, pallas"):
        generate_step.attention_for(jnp.float32, Config, 64, "cudnn")
