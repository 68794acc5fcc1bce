"""README's training-loop example (the reader section) runs as written on a real run."""

from __future__ import annotations

import pathlib
import re

import numpy as np

import reader
from tests import reader_fixtures as rf

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_training_loop_example_runs(tmp_path):
    text = README.read_text()
    section = text[text.index("#### Training on a stream"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 12
    truth = rf.build_run(str(tmp_path / "run"), num_partitions=4, partition_rows=16,
                         rows_per_shard=8, committed=(0, 1, 2, 3), dtype="bfloat16")
    scope = {"run_dir": truth.uri}
    exec(compile(code, "README.md (training on a stream)", "exec"), scope)
    batches, last = scope["batches"], scope["b"]
    # Both epochs ran to the end, and the probe's weights are those of the same SGD steps
    # replayed here in float64 on the fixture's values, standardised with numpy's
    # statistics (the stream's order is its own, tested in test_reader_stream).
    assert last.step == 2 * batches.steps_per_epoch - 1 and last.epoch == 1
    hook = "layers.0.resid_post"
    assert "batch_size=256, buffer_tokens=1 << 14, seed=0, epochs=2" in code
    rows, cols = np.nonzero(truth.committed_mask())
    all_x = truth.value(hook, rows, cols).astype(np.float64)
    mean, std = all_x.mean(axis=0), all_x.std(axis=0)
    want = np.zeros(truth.hidden)
    run = reader.open_run(truth.uri)
    for b in run.stream(hook, batch_size=256, buffer_tokens=1 << 14, seed=0, epochs=2):
        x = (truth.value(hook, b.rows, b.cols).astype(np.float64) - mean) / std
        y = (truth.tokens["input_ids"][b.rows, b.cols] % 2).astype(np.float64)
        want -= 0.05 * x.T @ (x @ want - y) / len(y)
    assert np.abs(want).sum() > 0
    np.testing.assert_allclose(scope["w"], want, rtol=1e-4, atol=1e-7)
