"""reader.trainers: the hand-offs to dictionary_learning (an ActivationBuffer drop-in) and
SAELens (its cached-activations dataset, read back with HF datasets as SAELens reads it);
docs/training.md's SAELens, dictionary_learning and sparsify blocks, run where each is installed."""

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


@pytest.mark.parametrize("follow", [False, True])
@pytest.mark.parametrize("max_tokens", [7, 35, 40, 10**9, None])
def test_saelens_export_max_tokens_writes_whole_rows_and_counts_the_rest(tmp_path,
                                                                       max_tokens, follow):
    """max_tokens=N writes floor(N / context_size) whole rows (none under one row: an
    empty dataset that still loads), the first rows of the unbounded export; tokens +
    dropped_tokens is every kept token, counted here from the run's truth. batch_size 7
    against rows of 10: rows straddle batches, and a bounded export stops mid-stream.
    follow=True: a following stream, whose unread rest is read and counted (no plan)."""
    datasets = pytest.importorskip("datasets")
    truth = _run(tmp_path)
    kept = int((truth.committed_mask()
                & ~np.isin(truth.tokens["input_ids"], rf.SPECIAL_IDS)).sum())
    assert kept > 40 and kept % 10  # a tail short of a row
    full = str(tmp_path / "full")
    whole = trainers.export_saelens(truth.uri, HOOK, full, context_size=10,
                                    exclude=["special"], batch_size=7, follow=follow)
    out = str(tmp_path / "cache")
    info = trainers.export_saelens(truth.uri, HOOK, out, context_size=10,
                                   max_tokens=max_tokens, exclude=["special"], batch_size=7,
                                   follow=follow)
    rows = kept // 10 if max_tokens is None else min(max_tokens // 10, kept // 10)
    assert info["rows"] == rows and info["tokens"] == rows * 10
    assert info["tokens"] + info["dropped_tokens"] == kept
    assert whole["tokens"] + whole["dropped_tokens"] == kept
    ds = datasets.load_from_disk(out)
    assert len(ds) == rows
    ds.set_format(type="numpy")
    if rows:
        expect = datasets.load_from_disk(full).with_format("numpy")[:rows]
        np.testing.assert_array_equal(ds[:]["token_ids"], expect["token_ids"])
        np.testing.assert_array_equal(ds[:]["blocks.0.hook_resid_post"],
                                      expect["blocks.0.hook_resid_post"])


def test_saelens_export_refuses_a_negative_max_tokens_before_writing(tmp_path):
    pytest.importorskip("datasets")
    truth = _run(tmp_path)
    out = tmp_path / "cache"
    with pytest.raises(ValueError, match="max_tokens"):
        trainers.export_saelens(truth.uri, HOOK, str(out), context_size=10, max_tokens=-1)
    assert not out.exists()


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


def test_export_without_datasets_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import sys

    from actx.schemas import errors

    truth = _run(tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)  # an import of it fails, as uninstalled
    out = tmp_path / "cache"
    with pytest.raises(errors.UserError) as e:
        trainers.export_saelens(truth.uri, HOOK, str(out))
    message = str(e.value)
    assert "\n" not in message and "pip install 'actx-lm[torch]'" in message
    assert not out.exists()  # refused before anything is written


# docs/training.md's SAELens blocks (SAETrainer fed by ActivationDataset, then the
# cached-activations route), imported as a module by this driver so that their
# `if __name__ == "__main__":` parts stay out, and called with a short schedule.
_SAELENS_DRIVE = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import training_recipes as recipes
run, cache = sys.argv[2], sys.argv[3]
saes = {"direct": recipes.train(run, batch=128, steps=1000, lr=3e-3),
        "cached": recipes.train_cached(run, cache, batch=128, steps=1000)}
recipes.train_cached(run, cache + "-defaults", steps=2)  # its own batch: 4,096 tokens
for name, sae in saes.items():
    np.savez(f"{sys.argv[1]}/{name}.npz", **{k: getattr(sae, k).detach().cpu().numpy()
                                             for k in ("W_enc", "b_enc", "W_dec", "b_dec")})
"""


@pytest.mark.skipif(not _saelens_python(), reason="sae-lens not installed here and "
                    "ACTX_SAELENS_PYTHON not set")
def test_saelens_recipes_of_the_docs_train_an_sae_from_the_run(tmp_path):
    """Both routes run as written (no hub: nothing could reach one here) and return SAEs
    that, applied with numpy to the run's raw activations (the normalization folded into
    the weights, as the page says), explain them with few latents: the run holds sparse
    sums of a dictionary (tests/test_sae_example.py), which an untrained SAE does not."""
    import os
    import pathlib
    import re
    import subprocess

    from actx.deploy import config as deploy_config
    from tests.test_sae_example import _sparse_run

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    routes = page[page.index("## SAELens 6"):page.index("## dictionary_learning")]
    code = re.findall(r"```python\n(.*?)```", routes, re.S)
    assert len(code) == 2 and all('if __name__ == "__main__":' in c for c in code)
    work = tmp_path / "drive"
    work.mkdir()
    (work / "training_recipes.py").write_text("\n\n".join(code))
    uri = _sparse_run(tmp_path)
    # One thread: torch's default pool only contends with itself on a small machine.
    env = {**os.environ, "PYTHONPATH": deploy_config.code_path(), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    done = subprocess.run([_saelens_python(), "-c", _SAELENS_DRIVE, str(work), uri,
                           str(tmp_path / "cache")], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    run = reader.open_run(uri)
    x = run.rows(HOOK, 0, run.total_rows).reshape(-1, run.hook(HOOK).hidden)
    x = x[np.linalg.norm(x, axis=1) > 0].astype(np.float64)  # the valid tokens

    def explained(p) -> tuple[float, float]:
        f = np.maximum((x - p["b_dec"]) @ p["W_enc"] + p["b_enc"], 0)
        error = f @ p["W_dec"] + p["b_dec"] - x
        return 1 - (error ** 2).sum() / ((x - x.mean(0)) ** 2).sum(), (f > 0).sum(1).mean()

    direct = explained(np.load(work / "direct.npz"))
    cached = explained(np.load(work / "cached.npz"))
    assert direct[0] > 0.4 and direct[1] < 16, direct  # of 512 latents; the data has 3
    assert cached[0] > 0.3, cached


def _python_with(module: str, variable: str) -> str | None:
    """An interpreter that has `module`: this one, or the one the environment variable
    `variable` names (the trainers bring packages of their own: wandb, nnsight,
    accelerate; a venv beside actx's pins)."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec(module) is not None:
        return sys.executable
    return os.environ.get(variable)


# docs/training.md's dictionary_learning and sparsify blocks, each imported as a module
# (so that its `if __name__ == "__main__":` part stays out) and called with a short
# schedule; the SAE's weights come back as arrays for numpy to apply.
_TRAINER_DRIVE = {
    "dictionary_learning": """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import training_recipe as recipe
sae = recipe.train(sys.argv[2], sys.argv[3], batch=128, steps=1500, lr=3e-3, l1_penalty=0.3)
np.savez(f"{sys.argv[1]}/sae.npz", **{k: v.detach().cpu().numpy() for k, v in {
    "W_enc": sae.encoder.weight.T, "b_enc": sae.encoder.bias, "W_dec": sae.decoder.weight.T,
    "b_dec": sae.bias}.items()})
""",
    "sparsify": """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import training_recipe as recipe
sae = recipe.train(sys.argv[2], batch=128, steps=1500, k=4, lr=3e-3, warmup_steps=50,
                   normalize=None)
np.savez(f"{sys.argv[1]}/sae.npz", k=sae.cfg.k, **{k: v.detach().cpu().numpy() for k, v in {
    "W_enc": sae.encoder.weight.T, "b_enc": sae.encoder.bias, "W_dec": sae.W_dec,
    "b_dec": sae.b_dec}.items()})
""",
}


def _apply_sae(p, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(reconstruction, latents) of an SAE's weights on `x`, in numpy: ReLU of the
    centred encoder, the k largest kept where the SAE is a TopK one."""
    f = np.maximum((x - p["b_dec"]) @ p["W_enc"] + p["b_enc"], 0)
    if "k" in p:
        k = int(p["k"])
        f = np.where(f >= np.sort(f, axis=1)[:, -k:][:, :1], f, 0)
    return f @ p["W_dec"] + p["b_dec"], f


@pytest.mark.parametrize("package,variable,heading", [
    ("dictionary_learning", "ACTX_DICTIONARY_LEARNING_PYTHON", "## dictionary_learning"),
    ("sparsify", "ACTX_SPARSIFY_PYTHON", "## sparsify"),
])
def test_trainer_recipe_of_the_docs_trains_an_sae_from_the_run(tmp_path, package, variable,
                                                               heading):
    """The page's block runs as written (a short schedule given to its function) and returns
    an SAE that, applied with numpy to the run's raw activations, explains them with few
    latents: the run holds sparse sums of a dictionary (tests/test_sae_example.py), which
    an untrained SAE does not."""
    import os
    import pathlib
    import re
    import subprocess

    python = _python_with(package, variable)
    if python is None:
        pytest.skip(f"{package} not installed here and {variable} not set")
    from actx.deploy import config as deploy_config
    from tests.test_sae_example import _sparse_run

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    section = page[page.index(heading):]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert f"from {package}" in code and 'if __name__ == "__main__":' in code
    work = tmp_path / "drive"
    work.mkdir()
    (work / "training_recipe.py").write_text(code)
    uri = _sparse_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": deploy_config.code_path(), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    done = subprocess.run([python, "-c", _TRAINER_DRIVE[package], str(work), uri,
                           str(tmp_path / "saved")], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    run = reader.open_run(uri)
    x = run.rows(HOOK, 0, run.total_rows).reshape(-1, run.hook(HOOK).hidden)
    x = x[np.linalg.norm(x, axis=1) > 0].astype(np.float64)  # the valid tokens
    p = dict(np.load(work / "sae.npz"))
    x_hat, f = _apply_sae(p, x)
    explained = 1 - ((x_hat - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    active = (f > 0).sum(1).mean()
    print(f"{package}: explained variance {explained:.3f}, mean active latents {active:.1f}")
    assert explained > 0.5 and active < 16, (explained, active)  # of 512 latents; data: 3
