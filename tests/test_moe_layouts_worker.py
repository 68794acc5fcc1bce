"""Qwen3-MoE with dense layers between sparse ones, Qwen2-MoE and gpt-oss through the
extraction worker as a real process: every stored hook equals HF on each document alone,
and `layers.*.experts` stores the router's points of the sparse layers only."""

from __future__ import annotations

import numpy as np
import pytest

from actx import reader
from tests import hf_models, token_runs, worker_procs

N_ROWS, PARTITION_ROWS = 16, 8
HOOKS = "embed,layers.*.resid_post,layers.*.mlp_out,layers.*.router_logits,layers.*.experts"


@pytest.mark.parametrize("arch,sparse", [("qwen3_moe_mixed", [1]), ("qwen2_moe", [0, 2]),
                                         ("gpt_oss", [0, 1, 2])])
def test_a_worker_stores_hf_values_on_the_sparse_layers(tmp_path, arch, sparse):
    model = hf_models.make_tiny_checkpoint(tmp_path / arch, arch)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, model, n_rows=N_ROWS, hooks=HOOKS,
                               partition_rows=PARTITION_ROWS, overflow="continue")
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"])
    assert code == 0, out
    opened = reader.open_run(run)
    routed = {int(h.split(".")[1]) for h in opened.hooks if h.endswith("expert_ids")}
    assert routed == set(sparse)
    assert {h.split(".")[-1] for h in opened.hooks if h.startswith("layers.")} == {
        "resid_post", "mlp_out", "router_logits", "expert_ids", "expert_weights"}
    hf = hf_models.load_hf_model(model)
    ids = token_runs.read_tokens(run, "input_ids")
    seg = token_runs.read_tokens(run, "segment_ids")
    pos = token_runs.read_tokens(run, "positions")
    stored = {h: token_runs.read_activation(run, h) for h in opened.hooks}
    checked = 0
    for row in (0, 9, 15):
        for s in range(1, int(seg[row].max()) + 1):
            cols = np.flatnonzero(seg[row] == s)
            if pos[row, cols[0]] != 0:  # a continued document: its start is elsewhere
                continue
            ref = hf_models.hf_hooks(hf, ids[row, cols][None])
            for hook, acts in stored.items():
                if hook.endswith("expert_ids"):
                    np.testing.assert_array_equal(acts[row, cols], ref[hook][0], hook)
                else:
                    worker_procs.assert_close(acts[row, cols], ref[hook][0], 1e-5,
                                              f"row {row} segment {s} {hook}")
            checked += 1
    assert checked >= 3
