"""GPT-2 and GPT-NeoX through the extraction worker as a real process: stored activations
equal HF on each document alone, activations/actx.json records the architecture, the
reader refuses TransformerLens names on these LayerNorm models (and accepts them on an
RMSNorm one), and a GPT-2 run whose documents could pass n_positions is refused before
any step."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from actx import reader
from tests import hf_models, token_runs, worker_procs

N_ROWS, PARTITION_ROWS = 16, 8


def _run(tmp_path, arch, hooks, **packing):
    model = hf_models.make_tiny_checkpoint(tmp_path / arch, arch)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model, n_rows=N_ROWS, hooks=hooks,
                               partition_rows=PARTITION_ROWS, **packing)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"])
    return model, run, code, out


@pytest.mark.parametrize("arch,hooks,overflow", [
    ("gpt_neox", "embed,layers.*.resid_post,layers.1.attn_out,layers.1.mlp_out,final_norm",
     "continue"),
    ("gpt2", "embed,layers.*.resid_mid,layers.2.mlp_out,final_norm", "truncate")])
def test_a_worker_stores_hf_values_and_records_the_architecture(tmp_path, arch, hooks,
                                                                overflow):
    model, run, code, out = _run(tmp_path, arch, hooks, overflow=overflow)
    assert code == 0, out
    hf = hf_models.load_hf_model(model)
    ids = token_runs.read_tokens(run, "input_ids")
    seg = token_runs.read_tokens(run, "segment_ids")
    opened = reader.open_run(run)
    stored = {h: token_runs.read_activation(run, h) for h in opened.hooks}
    checked = 0
    for row in (0, 9, 15):
        for s in range(1, int(seg[row].max()) + 1):
            cols = np.flatnonzero(seg[row] == s)
            ref = hf_models.hf_hooks(hf, ids[row, cols][None])
            for hook, acts in stored.items():
                worker_procs.assert_close(acts[row, cols], ref[hook][0], 1e-5,
                                          f"row {row} segment {s} {hook}")
            checked += 1
    assert checked >= 3
    with open(os.path.join(run, "activations", "actx.json")) as f:
        architecture = json.load(f)["architecture"]
    assert architecture == {"gpt2": "GPT2LMHeadModel",
                            "gpt_neox": "GPTNeoXForCausalLM"}[arch]
    assert opened.architecture == architecture
    assert all(h["transformer_lens"] is None for h in opened.describe()["hooks"].values())
    with pytest.raises(ValueError, match=r"center_writing_weights"):
        opened.hook("blocks.0.hook_resid_post" if arch == "gpt_neox"
                    else "blocks.0.hook_resid_mid")


def test_a_worker_on_an_rmsnorm_model_accepts_transformer_lens_names(tmp_path):
    _, run, code, out = _run(tmp_path, "qwen2", "blocks.*.hook_resid_post,hook_embed")
    assert code == 0, out
    opened = reader.open_run(run)
    assert sorted(opened.hooks) == ["embed", "layers.0.resid_post", "layers.1.resid_post",
                                    "layers.2.resid_post"]  # stored by actx's names
    assert opened.describe()["hooks"]["layers.1.resid_post"]["transformer_lens"] == \
        "blocks.1.hook_resid_post"
    np.testing.assert_array_equal(
        opened.rows("blocks.1.hook_resid_post", 0, 4), opened.rows("layers.1.resid_post", 0, 4))


def test_a_gpt2_run_continuing_documents_is_refused_before_any_step(tmp_path):
    _, run, code, out = _run(tmp_path, "gpt2", "layers.0.resid_post")
    assert code != 0
    assert ("packing.overflow='continue': GPT2LMHeadModel's learned position embeddings "
            "end at n_positions=64") in out, out
    assert not os.path.exists(os.path.join(run, "commits"))
