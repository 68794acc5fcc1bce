"""memory:// runs, the embedded default of notebooks: prepare, extract, read and verify in
one process share tensorstore's memory store (one Context), so every stage sees the others'
arrays and small objects."""

from __future__ import annotations

import numpy as np

from actx.deploy import verify
from actx.pipeline import main as prepare_main
from actx.pipeline import sample_data
from actx.schemas import commit, run_dir, runspec, store, worker_options
from tests import hf_models
from actx.workers.loop import runner


def test_prepare_extract_read_verify_in_memory(tmp_path, qwen_tokenizer_dir):
    model = hf_models.make_tiny_checkpoint(tmp_path / "m", "qwen2", vocab_size=151936,
                                           num_hidden_layers=2)
    text = sample_data.make_fineweb_parquet(str(tmp_path / "fw.parquet"), 10, seed=4)
    spec = runspec.RunSpec.from_dict({
        "model": {"path": str(model), "dtype": "float32"},
        "tokenizer": {"path": qwen_tokenizer_dir},
        "sources": [{"kind": "fineweb", "paths": [text]}],
        "packing": {"mode": "segmented", "seq_len": 64},
        "capture": {"hooks": "layers.1.resid_post", "dtype": "bfloat16"},
        "layout": {"rows_per_shard": 4, "partition_rows": 8},
    })
    run = f"memory://{tmp_path.name}/run"
    m = prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"])
    worker = runner.Worker(worker_options.WorkerOptions(run=run, batch_size=8))
    assert worker.run() == 0
    assert commit.committed_partitions(store.open_store(run)) == {p.id for p in m.partitions}

    from actx import reader

    r = reader.open_run(run)
    with r.batches("layers.1.resid_post", batch_size=32, drop_last=False, prefetch=1) as it:
        assert sum(len(b.rows) for b in it) == m.total_tokens
    report = verify.verify_run(run_dir.open_run(run))
    assert report.ok, report.problems
    assert report.checked == [p.id for p in m.partitions]
    assert np.isfinite(report.stats["layers.1.resid_post"].to_json_obj(64)["mean"])
