"""examples/train_sae.py trains a sparse autoencoder from a run: the loss falls and the
held-out explained variance is printed (and high, on activations that are sparse sums of
a dictionary, which an SAE can recover)."""

import importlib.util
import pathlib
import warnings

import numpy as np
import pytest

pytest.importorskip("torch")

from actx.reader import formats  # noqa: E402
from actx.schemas import layout  # noqa: E402
from actx.schemas import store as store_lib  # noqa: E402
from actx.schemas import ts_context  # noqa: E402
from tests import reader_fixtures as rf  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_sae.py"
HOOK = "layers.0.resid_post"


def _sparse_run(tmp_path, hidden=32, atoms=64, active=3) -> str:
    truth = rf.build_run(str(tmp_path / "run"), num_partitions=5, partition_rows=16,
                         rows_per_shard=8, seq_len=32, hidden=hidden, committed=tuple(range(5)))
    arr = ts_context.open_array(layout.array_spec(store_lib.open_store(truth.uri).location,
                                                  layout.activation_array_key(HOOK)))
    rng = np.random.default_rng(0)
    dictionary = rng.standard_normal((atoms, hidden)).astype(np.float32)
    dictionary /= np.linalg.norm(dictionary, axis=1, keepdims=True)
    rows, seq_len = arr.shape[0], arr.shape[1]
    n = rows * seq_len
    codes = np.zeros((n, atoms), np.float32)
    picks = np.argsort(rng.random((n, atoms)), axis=1)[:, :active]
    np.put_along_axis(codes, picks, rng.uniform(0.5, 2.0, (n, active)).astype(np.float32), 1)
    arr.write((codes @ dictionary).reshape(rows, seq_len, hidden)).result()
    return truth.uri


def test_sae_example_loss_falls_and_reports_held_out_explained_variance(tmp_path, capsys):
    uri = _sparse_run(tmp_path)
    spec = importlib.util.spec_from_file_location("train_sae", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # Its statistics are of the tokens its stream serves: no warning that they are not.
    with warnings.catch_warnings():
        warnings.simplefilter("error", formats.StatisticsOfOtherTokens)
        result = example.main([uri, "--hook", HOOK, "--steps", "300"])
    losses = result["losses"]
    assert len(losses) == 300
    assert np.mean(losses[-30:]) < 0.5 * np.mean(losses[:10])
    out = capsys.readouterr().out
    assert "explained variance on held-out partition 4:" in out
    assert result["explained_variance"] > 0.7
