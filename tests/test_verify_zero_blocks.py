"""A stored block that is all zeros is no false alarm (issue 66, item 9): the store keeps
a chunk equal to the fill value as no object, so a hook that outputs zeros leaves no
object behind; `actx verify` tells that block (its marker's checksum is that of zeros)
from one never written (an object lost: the marker's checksum is not). Real worker
processes on a tiny Qwen2 whose layer 0 attention output projection is zero, so
layers.0.attn_out is exactly zero at every token (HF says so too)."""

from __future__ import annotations

import io
import os

import numpy as np

from actx.deploy import cli
from actx.schemas import layout
from tests import hf_models, token_runs

HOOKS = "layers.0.attn_out,layers.0.resid_post"


def _zero_attention_output(path) -> str:
    import torch
    import transformers

    hf_models.make_tiny_checkpoint(path, "qwen2", num_hidden_layers=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
    model.save_pretrained(path)
    return str(path)


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(list(argv), out=out), out.getvalue()


def test_zeros_written_verify_and_a_lost_block_does_not(tmp_path):
    model = _zero_attention_output(tmp_path / "model")
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model, n_rows=16, seq_len=16, partition_rows=8,
                               rows_per_shard=4, hooks=HOOKS)
    code, said = _cli("rerun", run, "--batch-size", "4")
    assert code == 0, said
    # The reference: HF computes zeros for this hook on the stored tokens.
    hf = hf_models.load_hf_model(model)
    ids = token_runs.read_tokens(run, "input_ids")[:1]
    assert not np.any(hf_models.hf_hooks(hf, ids)["layers.0.attn_out"])
    shard_dir = os.path.join(run, layout.activation_shard_prefix("layers.0.attn_out"))
    assert not os.path.isdir(shard_dir) or not any(
        files for _, _, files in os.walk(shard_dir))  # the store kept no object at all
    code, out = _cli("verify", run)
    assert code == 0 and "OK: every committed block matches its checksum" in out, out

    # A block of the other hook lost: never written, as before.
    prefix = layout.activation_shard_prefix("layers.0.resid_post")
    lost = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run, prefix))
                  for f in fs)[0]
    os.remove(lost)
    code, out = _cli("verify", run)
    assert code == 1, out
    assert "array layers.0.resid_post: block 0 (rows 0-3) was never written" in out, out
    assert "its marker's checksum is not that of zeros" in out
    assert "layers.0.attn_out: block" not in out
