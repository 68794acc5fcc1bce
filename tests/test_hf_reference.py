"""deploy.hf_reference (what `actx verify --reference` recomputes with) gives, for every
architecture actx supports, the hooks and masks the suite's own HF reference gives
(tests/hf_models.py, against which every actx activation is tested): the same hook
mapping (Gemma's post-norms included) and, from a document's `context_start`, the same
view past max_context (one window, or one per layer type)."""

from __future__ import annotations

import numpy as np
import pytest

from actx.deploy import hf_reference
from tests import hf_models

MAX_CONTEXT = 24


@pytest.mark.parametrize("arch,overrides", [(a, {}) for a in hf_models.ARCHS]
                         + [("mistral", {"sliding_window": 12}), ("gpt2", {}),
                            # the sequential block, whose resid_mid the list asks for
                            ("gpt_neox", {"use_parallel_residual": False})])
def test_hooks_and_masks_equal_the_suites_reference(arch, overrides, tmp_path):
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    ref = hf_reference.load(path)
    suite = hf_models.load_hf_model(path)
    ids = np.random.default_rng(0).integers(1, 500, 40)
    hooks = ["embed", "final_norm"] + [f"layers.{i}.{p}" for i in range(ref.num_layers)
                                       for p in ("resid_pre", "attn_out", "resid_mid",
                                                 "mlp_out", "resid_post")]
    for max_context in (MAX_CONTEXT, 64):  # past it, and the whole document
        context_start = np.maximum(0, np.arange(len(ids)) - max_context + 1)
        mine = hf_reference.hooks(ref, ids, context_start, hooks)
        want = hf_models.hf_hooks(suite, ids[None], attention_mask=hf_models.context_mask(
            suite, len(ids), max_context))
        assert all(hf_reference.supports(h, ref.num_layers) for h in hooks)
        for hook in hooks:
            np.testing.assert_allclose(mine[hook], want[hook][0], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{arch} {hook} max_context {max_context}")
    # The check can fail: seeing the whole document past max_context is another result.
    whole = hf_reference.hooks(ref, ids, np.zeros(len(ids), np.int64), ["final_norm"])
    past = hf_reference.hooks(ref, ids, np.maximum(0, np.arange(len(ids)) - MAX_CONTEXT + 1),
                              ["final_norm"])
    window = getattr(ref.text_config, "sliding_window", None)
    if arch != "mistral" or not window:  # Mistral's own window of 12 hides max_context
        assert not np.allclose(whole["final_norm"][-1], past["final_norm"][-1], atol=1e-4)
    assert not hf_reference.supports("layers.99.resid_post", ref.num_layers)
