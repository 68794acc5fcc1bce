"""README's training-loop example (the reader section) runs as written on a real run."""

from __future__ import annotations

import pathlib
import re

import numpy as np

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
    # Both epochs ran to the end, and the probe's weights moved.
    assert last.step == 2 * batches.steps_per_epoch - 1 and last.epoch == 1
    assert np.isfinite(scope["w"]).all() and np.abs(scope["w"]).sum() > 0
