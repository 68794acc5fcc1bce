"""reader.trainers: the hand-offs to dictionary_learning (an ActivationBuffer drop-in) and
SAELens (its cached-activations dataset, read back with HF datasets as SAELens reads it)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from actx import reader  # noqa: E402
from actx.reader import trainers  # noqa: E402
from tests import reader_fixtures as rf  # noqa: E402

HOOK = "layers.0.resid_post"
T = 16


def _run(tmp_path) -> rf.RunTruth:
    return rf.build_run(str(tmp_path / "run"), num_partitions=3, partition_rows=8,
                        rows_per_shard=4, committed=(0, 1, 2))


def test_activation_buffer_is_an_endless_iterator_of_batches_of_its_shape(tmp_path):
    truth = _run(tmp_path)
    buffer = trainers.ActivationBuffer(truth.uri, HOOK, out_batch_size=32, device="cpu",
                                       exclude=["bos"], buffer_tokens=4 * T, block_rows=4)
    assert buffer.d_submodule == truth.hidden and buffer.config["out_batch_size"] == 32
    kept = truth.committed_mask() & (truth.tokens["input_ids"] != rf.BOS_ID)
    first = np.zeros(kept.shape, bool)
    for d in truth.docs:
        first[d["first_row"], d["first_col"]] = True
    kept &= ~first
    per_epoch = kept.sum() // 32
    seen = []
    # dictionary_learning's trainSAE: `for step, act in enumerate(data)`, up to `steps`.
    for step, act in enumerate(buffer):
        if step == 3 * per_epoch:  # runs on past one epoch: endless, as theirs
            break
        assert act.shape == (32, truth.hidden) and act.dtype == torch.float32
        seen.append(rf.decode_flat(act.numpy(), T))
    buffer.close()
    first_epoch = np.concatenate(seen[:per_epoch])
    assert len(np.unique(first_epoch)) == len(first_epoch)  # no token twice in an epoch
    assert np.isin(first_epoch, np.flatnonzero(kept)).all()
    assert np.isin(np.concatenate(seen), np.flatnonzero(kept)).all()


def test_saelens_export_reads_back_as_saelens_reads_it(tmp_path):
    datasets = pytest.importorskip("datasets")
    truth = _run(tmp_path)
    run = reader.open_run(truth.uri)
    out = str(tmp_path / "cache")
    info = trainers.export_saelens(run, [HOOK, "embed"], out, context_size=10,
                                   exclude=["special"], batch_size=7)
    assert info["hook_names"] == ["blocks.0.hook_resid_post", "hook_embed"]
    kept = truth.committed_mask() & ~np.isin(truth.tokens["input_ids"], rf.SPECIAL_IDS)
    assert info["tokens"] == kept.sum() // 10 * 10 and info["dropped_tokens"] == kept.sum() % 10
    # What SAELens's ActivationsStore.load_cached_activation_dataset does and checks.
    ds = datasets.load_from_disk(out)
    assert ds.features["blocks.0.hook_resid_post"].shape == (10, truth.hidden)
    assert len(ds) == info["rows"] == kept.sum() // 10
    ds.set_format(type="torch", columns=["blocks.0.hook_resid_post", "hook_embed", "token_ids"],
                  dtype=torch.float32)
    acts = ds[:]["blocks.0.hook_resid_post"].reshape(-1, truth.hidden).numpy()
    flat = rf.decode_flat(acts, T)
    assert len(np.unique(flat)) == len(flat) and np.isin(flat, np.flatnonzero(kept)).all()
    rows, cols = flat // T, flat % T
    np.testing.assert_array_equal(acts, truth.value(HOOK, rows, cols))
    np.testing.assert_array_equal(ds[:]["hook_embed"].reshape(-1, truth.hidden).numpy(),
                                  truth.value("embed", rows, cols))
    np.testing.assert_array_equal(ds[:]["token_ids"].reshape(-1).numpy(),
                                  truth.tokens["input_ids"][rows, cols])
    with pytest.raises(ValueError, match="not empty"):
        trainers.export_saelens(run, HOOK, out)


def test_transformer_lens_names():
    assert trainers.transformer_lens_name("layers.12.resid_post") == "blocks.12.hook_resid_post"
    assert trainers.transformer_lens_name("layers.3.mlp_out") == "blocks.3.hook_mlp_out"
    assert trainers.transformer_lens_name("final_norm") == "final_norm"


_SAELENS_READ = """
import json, sys, torch
from sae_lens.training.activations_store import ActivationsStore
path, hook, ctx, d_in = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = ActivationsStore(
    model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None,
    context_size=ctx, d_in=d_in, n_batches_in_buffer=4, total_training_tokens=10**6,
    store_batch_size_prompts=4, train_batch_size_tokens=16, prepend_bos=False,
    normalize_activations="none", device=torch.device("cpu"), dtype="float32",
    cached_activations_path=path)
print(json.dumps([store.next_batch().tolist() for _ in range(10)]))
"""


def _saelens_python():
    """An interpreter with sae-lens: this one, or ACTX_SAELENS_PYTHON (sae-lens resolves
    with actx's pins but brings transformer-lens, wandb, pandas: a venv of its own)."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("sae_lens") is not None:
        return sys.executable
    return os.environ.get("ACTX_SAELENS_PYTHON")


@pytest.mark.skipif(not _saelens_python(), reason="sae-lens not installed here and "
                    "ACTX_SAELENS_PYTHON not set")
def test_saelens_activations_store_trains_from_the_export(tmp_path):
    import json
    import subprocess

    truth = _run(tmp_path)
    out = str(tmp_path / "cache")
    info = trainers.export_saelens(truth.uri, HOOK, out, context_size=8, exclude=["special"])
    done = subprocess.run([_saelens_python(), "-c", _SAELENS_READ, out, info["hook_names"][0],
                           "8", str(truth.hidden)], capture_output=True, text=True,
                          check=True, cwd=str(tmp_path))
    batches = np.asarray(json.loads(done.stdout.splitlines()[-1]), np.float32)
    assert batches.shape == (10, 16, truth.hidden)  # SAELens's own batches of its d_in
    acts = batches.reshape(-1, truth.hidden)
    flat = rf.decode_flat(acts, T)
    kept = truth.committed_mask() & ~np.isin(truth.tokens["input_ids"], rf.SPECIAL_IDS)
    assert np.isin(flat, np.flatnonzero(kept)).all()
    np.testing.assert_array_equal(acts, truth.value(HOOK, flat // T, flat % T))
