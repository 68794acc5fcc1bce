"""Float8 activations with per-token scales (capture.dtype float8_e4m3), end to end.

A real worker process extracts a tiny random Qwen2 into float8; the stored values times
their scales are checked against HF transformers' float32 activations within the bound the
format gives (half a unit in e4m3's last place, 2^-4 of a value, or 2^-10 of the token's
scale below the normal range), and every reader (rows, gather, select, stream, batches,
compute_stats, zarr-python) against the stored arrays read by tensorstore and
multiplied here. verify checks the scale arrays as it checks the values.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from actx.schemas import commit, layout, quantised, store
from tests import hf_models, token_runs, worker_procs

HOOKS = "embed,layers.*.resid_post,layers.1.attn_out"
N_ROWS = 16
PARTITION_ROWS = 8
# What the format allows a value to differ from the float32 activation: half an e4m3 ulp
# relative (3 mantissa bits) for normal values, half the smallest subnormal (2^-9) times
# the token's scale below them; float32 compute differences are far below both.
E4M3_RELATIVE = 2.0 ** -4
E4M3_SUBNORMAL_ABS = 2.0 ** -10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return hf_models.make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def float8_run(model_dir, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("f8") / "run")
    token_runs.write_token_run(run, str(model_dir), n_rows=N_ROWS, hooks=HOOKS,
                               dtype="float8_e4m3", partition_rows=PARTITION_ROWS)
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8"])
    assert code == 0, out
    return run


def _stored(run: str, hook: str) -> tuple[np.ndarray, np.ndarray]:
    return (token_runs.read_activation(run, hook),
            token_runs.read_activation(run, quantised.scale_array(hook)))


def _hooks(run: str) -> list[str]:
    with open(os.path.join(run, layout.ACTIVATIONS_INFO_KEY)) as f:
        return sorted(json.load(f)["hooks"])


def test_stored_float8_times_scale_matches_hf_within_the_format(float8_run, model_dir):
    hf = hf_models.load_hf_model(model_dir)
    ids = token_runs.read_tokens(float8_run, "input_ids")
    seg = token_runs.read_tokens(float8_run, "segment_ids")
    hooks = _hooks(float8_run)
    assert hooks == ["embed", "layers.0.resid_post", "layers.1.attn_out",
                     "layers.1.resid_post", "layers.2.resid_post"]
    checked = 0
    for hook in hooks:
        values, scale = _stored(float8_run, hook)
        assert values.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        assert scale.dtype == np.float32 and scale.shape == values.shape[:2] + (1,)
        for row in (0, 5, 9, 15):
            for s in range(1, int(seg[row].max()) + 1):
                cols = np.flatnonzero(seg[row] == s)
                ref = hf_models.hf_hooks(hf, ids[row, cols][None])[hook][0].astype(np.float64)
                got = values[row, cols].astype(np.float64) * scale[row, cols]
                absmax = np.abs(ref).max(axis=-1, keepdims=True)
                # The token's scale is its absmax over e4m3's largest finite value.
                np.testing.assert_allclose(scale[row, cols], absmax / 448.0, rtol=1e-5)
                bound = (np.abs(ref) * E4M3_RELATIVE + absmax / 448.0 * E4M3_SUBNORMAL_ABS
                         + 1e-5 * absmax)
                assert np.all(np.abs(got - ref) <= bound), (hook, row, s)
                # Relative L2 per token: within the format's relative bound too (the
                # real model's per-document figure is bench/quantised_sae.py's).
                rel = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
                assert rel.max() <= E4M3_RELATIVE, (hook, row, s, rel.max())
                checked += 1
    assert checked >= 16


def test_markers_checksum_scales_and_verify_checks_them(float8_run, tmp_path):
    import shutil

    from actx.deploy import verify
    from actx.schemas import run_dir

    s = store.open_store(float8_run)
    marker = commit.read_marker(s, 0)
    scale_name = quantised.scale_array("layers.1.resid_post")
    assert marker.dtypes[scale_name] == "float32"
    assert marker.dtypes["layers.1.resid_post"] == "float8_e4m3fn"
    _, scale = _stored(float8_run, "layers.1.resid_post")
    assert marker.checksums[scale_name][0] == commit.checksum(
        np.ascontiguousarray(scale[0:4]).tobytes())
    report = verify.verify_run(run_dir.RunDir.at(float8_run).opened())
    assert report.ok, report.problems
    assert sorted(report.hooks) == _hooks(float8_run)
    # Health is of the dequantised values: the mean norm of what a reader returns.
    values, scale = _stored(float8_run, "layers.1.resid_post")
    seg = token_runs.read_tokens(float8_run, "segment_ids")
    deq = (values.astype(np.float64) * scale)[seg > 0]
    assert report.stats["layers.1.resid_post"].to_json_obj(64)["mean_norm"] == pytest.approx(
        float(np.linalg.norm(deq, axis=-1).mean()), rel=1e-6)
    # A damaged scale object is found like a damaged value object.
    copy = str(tmp_path / "run")
    shutil.copytree(float8_run, copy)
    key = os.path.join(copy, layout.activation_shard_key(scale_name, 1))
    with open(key, "r+b") as f:
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 0xFF]))
    damaged = verify.verify_run(run_dir.RunDir.at(copy).opened())
    assert not damaged.ok
    assert any(scale_name in p for p in damaged.problems), damaged.problems
    assert damaged.failed == [0]


def test_readers_return_dequantised_float32_or_bfloat16(float8_run):
    import actx

    run = actx.open_run(float8_run)
    hook = "layers.1.resid_post"
    values, scale = _stored(float8_run, hook)
    expected = values.astype(np.float32) * scale  # [rows, T, hidden], float32
    info = run.hook(hook)
    assert (info.dtype, info.stored_dtype, info.quantised) == ("float32", "float8_e4m3fn", True)
    assert run.describe()["hooks"][hook]["dtype"] == "float32"
    rows = run.rows(hook, 8, 12)
    assert rows.dtype == np.float32
    np.testing.assert_array_equal(rows, expected[8:12])
    np.testing.assert_array_equal(run.tokens(hook, 3, 2, 9), expected[3, 2:9])
    r, c = np.array([0, 5, 15, 9]), np.array([1, 0, 7, 3])
    np.testing.assert_array_equal(run.gather([hook], r, c)[hook], expected[r, c])
    sel = run.select(hook, exclude=("padding",))
    np.testing.assert_array_equal(sel.acts[hook], expected[sel.rows, sel.cols])
    for kind in ("stream", "batches"):
        reader = getattr(run, kind)
        with reader(hook, batch_size=16, seed=3) as batches:
            batch = next(iter(batches))
        assert batch.acts[hook].dtype == np.float32
        np.testing.assert_array_equal(batch.acts[hook], expected[batch.rows, batch.cols])
        with reader(hook, batch_size=16, seed=3, dtype="bfloat16") as batches:
            half = next(iter(batches))
        assert half.acts[hook].dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(
            half.acts[hook], expected[half.rows, half.cols].astype(ml_dtypes.bfloat16))
        with pytest.raises(ValueError, match="float8 run.*float32 or bfloat16"):
            reader(hook, batch_size=16, dtype="float8_e4m3fn")
    # JAX batches: float8 values and scales go to the device, multiplied there.
    for dtype, np_dtype in ((None, np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        with run.stream(hook, batch_size=16, seed=3, framework="jax", dtype=dtype) as batches:
            batch = next(iter(batches))
        assert batch.acts[hook].dtype == np.dtype(np_dtype)
        np.testing.assert_array_equal(np.asarray(batch.acts[hook]),
                                      expected[batch.rows, batch.cols].astype(np_dtype))


def test_stream_reads_scales_beside_values_from_mapped_shards(model_dir, tmp_path):
    """codec none: the stream maps the values' and the scales' shard files alike."""
    import actx

    run_path = str(tmp_path / "run")
    token_runs.write_token_run(run_path, str(model_dir), n_rows=8, hooks="layers.0.resid_post",
                               dtype="float8_e4m3", partition_rows=8, codec="none")
    code, out = worker_procs.run_worker(["--run", run_path, "--batch-size", "8"])
    assert code == 0, out
    run = actx.open_run(run_path)
    hook = "layers.0.resid_post"
    values, scale = _stored(run_path, hook)
    with run.stream(hook, batch_size=8, seed=1) as stream:
        assert stream.read_paths == {hook: "mapped", quantised.scale_array(hook): "mapped"}
        for batch in stream:
            np.testing.assert_array_equal(
                batch.acts[hook], values[batch.rows, batch.cols].astype(np.float32)
                * scale[batch.rows, batch.cols])


def test_compute_stats_and_outlier_norms_on_dequantised_values(float8_run, tmp_path):
    import shutil

    import actx

    copy = str(tmp_path / "run")
    shutil.copytree(float8_run, copy)
    run = actx.open_run(copy)
    hook = "layers.0.resid_post"
    stats = run.compute_stats([hook])[hook]
    values, scale = _stored(copy, hook)
    seg = token_runs.read_tokens(copy, "segment_ids")
    deq = (values.astype(np.float64) * scale)[seg > 0]
    np.testing.assert_allclose(stats.mean, deq.mean(axis=0), rtol=1e-6, atol=1e-9)
    assert stats.mean_norm == pytest.approx(float(np.linalg.norm(deq, axis=-1).mean()),
                                            rel=1e-6)
    from actx.schemas import ts_context

    norms = ts_context.open_array({"driver": "zarr3", "kvstore": {
        "driver": "file", "path": os.path.join(copy, layout.norms_array_key(hook))}}
    ).read().result()
    np.testing.assert_allclose(norms[seg > 0], np.linalg.norm(deq, axis=-1), rtol=1e-6)


def test_zarr_python_reads_values_and_scales_as_docs_reading_shows(float8_run):
    """docs/reading.md's "Float8 runs" block, run as written: its two lines equal the
    reader's rows."""
    import pathlib
    import re

    import actx

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "reading.md").read_text()
    section = text[text.index("## Float8 runs"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {"run_dir": float8_run}
    exec(compile(code, "docs/reading.md (float8 runs)", "exec"), scope)
    hook = scope["hook"]
    assert scope["values"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(scope["acts"], actx.open_run(float8_run).rows(hook, 0, 8))


def test_quantise_rule_zero_rows_stay_zero_and_device_equals_numpy():
    """The device's rule (workers.model.quantise) against numpy's (schemas.quantised) and
    against the definition: zero rows keep scale 1 and values 0; a token's absmax maps to
    448 exactly; values beyond the rounding of the top are clipped, never NaN."""
    import jax.numpy as jnp

    from actx.workers.model import quantise

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32) * np.float32(3.0)
    x[0, 1] = 0.0
    x[1, 2, 7] = 1e4  # a massive activation in one dimension
    x[1, 3] *= np.float32(1e-30)  # tiny but not zero
    values, scale = quantise.quantise_hook(jnp.asarray(x), "float8_e4m3")
    values, scale = np.asarray(values), np.asarray(scale)
    np_values, np_scale = quantised.quantise(x)
    np.testing.assert_array_equal(scale, np_scale)
    np.testing.assert_array_equal(values.view(np.uint8), np_values.view(np.uint8))
    assert scale[0, 1, 0] == 1.0 and not values[0, 1].astype(np.float32).any()
    nonzero = np.abs(x).max(-1) > 0
    np.testing.assert_allclose(scale[..., 0][nonzero], np.abs(x).max(-1)[nonzero] / 448.0,
                               rtol=1e-6)
    top = np.abs(values.astype(np.float32)).max(-1)
    assert np.all((top == 448.0) | (scale[..., 0] == 1.0))
    assert np.isfinite(values.astype(np.float32)).all()
    # dequantise in bfloat16 is the float32 product rounded once
    bf = quantised.dequantise(np_values, np_scale, "bfloat16")
    np.testing.assert_array_equal(
        bf, (np_values.astype(np.float32) * np_scale).astype(ml_dtypes.bfloat16))


def test_a_generating_run_stores_float8_with_scales(tmp_path, qwen_tokenizer_dir):
    """Generation quantises its hooks on the device too: HF generate's answer, every token's
    dequantised activations within the format of HF's forward, zeros (scale 1) in the room
    a sample did not reach, and verify passes."""
    import actx
    from actx.deploy import verify
    from actx.schemas import run_dir, runspec
    from tests import generate_runs

    model = generate_runs.tiny_qwen2(tmp_path / "qwen2")
    prompts = generate_runs.write_prompts(tmp_path / "prompts.jsonl")
    spec = generate_runs.spec_dict(model, qwen_tokenizer_dir, prompts, max_new_tokens=12,
                                   stop_token_ids=[generate_runs.STOP])
    spec["capture"]["dtype"] = "float8_e4m3"
    run = str(tmp_path / "run")
    generate_runs.generated_run(run, runspec.RunSpec.from_dict(spec))
    hf = hf_models.load_hf_model(model)
    doc_index = token_runs.read_tokens(run, "doc_index")
    positions = token_runs.read_tokens(run, "positions")
    input_ids = token_runs.read_tokens(run, "input_ids")
    hook = generate_runs.HOOKS.split(",")[-1]
    values, scale = _stored(run, hook)
    for d, e in generate_runs.records(run).items():
        where = np.nonzero(doc_index == d)
        order = np.argsort(positions[where])
        r, c = where[0][order], where[1][order]
        text = np.concatenate([input_ids[r, c][:e["prompt_tokens"]], e["generated_ids"]])
        n = len(text)
        ref = hf_models.hf_hooks(hf, text[None].astype(np.int64))[hook][0].astype(np.float64)
        got = values[r[:n], c[:n]].astype(np.float64) * scale[r[:n], c[:n]]
        absmax = np.abs(ref).max(axis=-1, keepdims=True)
        bound = np.abs(ref) * E4M3_RELATIVE + absmax / 448 * E4M3_SUBNORMAL_ABS + 1e-5 * absmax
        assert np.all(np.abs(got - ref) <= bound), d
        assert not values[r[n:], c[n:]].astype(np.float32).any()
        assert (scale[r[n:], c[n:]] == 1).all()
    assert verify.verify_run(run_dir.RunDir.at(run).opened()).ok
    rows = actx.open_run(run).rows(hook, 0, 2)
    np.testing.assert_array_equal(rows, values[:2].astype(np.float32) * scale[:2])


def test_a_float8_extraction_beside_a_float32_one_reads_aligned(float8_run, model_dir,
                                                                tmp_path):
    """Several models on one token store: the same model's float32 extraction added to the
    float8 run; aligned_stream pairs each token's dequantised float8 values with the
    float32 ones, within the format's bound."""
    import dataclasses
    import shutil

    from actx.reader import aligned
    from actx.schemas import extraction, runspec

    run = str(tmp_path / "run")
    shutil.copytree(float8_run, run)
    s = store.open_store(run)
    root = runspec.read_run_spec(s)
    extraction.add(s, root, "exact", extraction.spec_for(
        root, root.model, dataclasses.replace(root.capture, dtype="float32")))
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "8",
                                         "--extraction", "exact"])
    assert code == 0, out
    hook = "layers.2.resid_post"
    with aligned.aligned_stream(run, ["", "exact"], hook, 16, buffer_tokens=64,
                                drop_last=False) as stream:
        seen = 0
        for batch in stream:
            assert batch.extractions == ("", "exact")
            f8, f32 = batch.acts[:, 0], batch.acts[:, 1]  # [n, models, d]: one width
            assert f8.dtype == np.float32
            absmax = np.abs(f32).max(-1, keepdims=True)
            assert np.all(np.abs(f8 - f32) <= np.abs(f32) * E4M3_RELATIVE
                          + absmax / 448 * E4M3_SUBNORMAL_ABS + 1e-5 * absmax)
            seen += len(batch)
    assert seen == int((token_runs.read_tokens(run, "segment_ids") > 0).sum())


def test_trainers_take_float8_dequantised_and_refuse_float8_by_name(float8_run, tmp_path):
    import torch

    from actx.reader import torch_data, trainers

    hook = "layers.1.resid_post"
    values, scale = _stored(float8_run, hook)
    dataset = torch_data.ActivationDataset(float8_run, hook, 8, with_tokens=True)
    acts, tokens = next(iter(dataset))
    assert acts.dtype == torch.float32
    r, c = tokens["rows"].numpy(), tokens["cols"].numpy()
    np.testing.assert_array_equal(acts.numpy(), values[r, c].astype(np.float32) * scale[r, c])
    with pytest.raises(ValueError, match="float8_e4m3fn.*pyarrow"):
        trainers.export_saelens(float8_run, hook, str(tmp_path / "out"), dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="float8 run.*float32 or bfloat16"):
        trainers.export_saelens(float8_run, hook, str(tmp_path / "out16"), dtype="float16")
    assert not os.path.exists(tmp_path / "out16")


def test_beam_extraction_writes_the_worker_targets_float8_bytes(float8_run, tmp_path):
    """The Beam transform extracts float8 as the worker target does: the same value and
    scale objects, byte for byte (both 4 devices, batch 8), and the same markers."""
    import subprocess
    import sys

    run = worker_procs.copy_token_store(float8_run, str(tmp_path / "run"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "actx.adapters.beam_extract", "--run", run, "--batch-size",
         "8", "--job", "beam", "--runner=FnApiRunner"], env=worker_procs.worker_env(4),
        cwd=worker_procs.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, out = worker_procs.finish(proc, timeout=600)
    assert code == 0, out
    worker_procs.assert_same_activations(run, float8_run)
    assert any(quantised.is_scale_array(k.split("/")[1])
               for k in worker_procs.stored_objects(run))
    s, ref = store.open_store(run), store.open_store(float8_run)
    for p in commit.committed_partitions(ref):
        assert commit.read_marker(s, p).checksums == commit.read_marker(ref, p).checksums


def _write_doc_tables(run: str) -> None:
    """docs/p-NNNNN.jsonl for a token store of tests.token_runs (which writes none): each
    document's first place and length, from tokens/doc_index."""
    doc_index = token_runs.read_tokens(run, "doc_index")
    os.makedirs(os.path.join(run, "docs"), exist_ok=True)
    lines: dict[int, list[str]] = {}
    for d in sorted(set(np.unique(doc_index).tolist()) - {-1}):
        r, c = np.nonzero(doc_index == d)
        lines.setdefault(int(r[0]) // PARTITION_ROWS, []).append(json.dumps(
            {"doc_index": d, "doc_id": f"d{d}", "first_row": int(r[0]),
             "first_col": int(c[0]), "n_tokens": len(r)}))
    for pid, entries in lines.items():
        with open(os.path.join(run, layout.docs_key(pid)), "w") as f:
            f.write("".join(e + "\n" for e in entries))


def test_verify_reference_holds_float8_to_the_formats_tolerance(float8_run, tmp_path):
    """`verify --reference`'s tolerance for float8 is the format's (2^-4 + 6e-4): the clean
    run passes with errors above float32's 1e-4 and within it; scales 10% off fail."""
    import shutil

    from actx.deploy import verify_reference
    from actx.schemas import run_dir, ts_context

    run = str(tmp_path / "run")
    shutil.copytree(float8_run, run)
    _write_doc_tables(run)
    record = verify_reference.check(run_dir.RunDir.at(run).opened(), n=4)
    assert record.ok, record.failures
    assert record.tolerance == pytest.approx(2.0 ** -4 + 6e-4)
    assert 1e-4 < max(record.hooks.values()) <= 2.0 ** -4 + 6e-4
    scale_key = os.path.join(run, layout.activation_array_key(
        quantised.scale_array("layers.1.attn_out")))
    arr = ts_context.open_array({"driver": "zarr3", "kvstore": {"driver": "file",
                                                                 "path": scale_key}})
    arr.write(arr.read().result() * np.float32(1.1)).result()
    record = verify_reference.check(run_dir.RunDir.at(run).opened(), n=2)
    assert not record.ok
    assert all(" hook layers.1.attn_out: relative error " in f for f in record.failures)


def test_dry_run_sizes_float8_values_and_scales_as_submit_writes_them(tmp_path,
                                                                      qwen_tokenizer_dir):
    """`actx submit --dry-run`'s cost lines for a float8 run (the bytes the estimate
    builds on): each hook's values at one byte and its scale array at four bytes a token,
    the shapes, data types, bytes and objects of what the real submit then stores."""
    import io
    import re

    import yaml

    from actx.deploy import cli

    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", vocab_size=151936,
                                           num_hidden_layers=2)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"note {i} " + "words here " * (i % 7 + 1)})
                             + "\n" for i in range(40)))
    run = str(tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "run": run,
        "spec": {"name": "f8", "model": {"path": str(model)},
                 "tokenizer": {"path": qwen_tokenizer_dir},
                 "sources": [{"kind": "text", "paths": [str(texts)]}],
                 "packing": {"seq_len": 32},
                 "layout": {"rows_per_shard": 2, "partition_rows": 4},
                 "capture": {"hooks": "layers.*.resid_post", "dtype": "float8_e4m3"}},
        "target": {"kind": "local", "hosts": 1, "batch_size": 4}}))
    out = io.StringIO()
    assert cli.main(["submit", str(path), "--dry-run"], out=out) == 0, out.getvalue()
    said = out.getvalue()
    arrays = dict(re.findall(r"#   (layers\.\d\.resid_post(?:\.scale)?): (\[.*)", said))
    assert sorted(arrays) == ["layers.0.resid_post", "layers.0.resid_post.scale",
                              "layers.1.resid_post", "layers.1.resid_post.scale"]
    assert "in 2 hook(s) and their 2 float8 scale array(s);" in said
    assert cli.main(["submit", str(path)], out=io.StringIO()) == 0
    for name, line in arrays.items():
        shape, dtype, size, shards = re.match(
            r"\[([\d, ]+)\] (\w+) = ([\d.,]+ \w+) in ([\d,]+) objects", line).groups()
        meta = json.load(open(os.path.join(run, layout.ACTIVATIONS_GROUP, name, "zarr.json")))
        assert meta["shape"] == [int(x.replace(",", "")) for x in shape.split(", ")]
        assert dtype == meta["data_type"]
        assert dtype == ("float32" if name.endswith(".scale") else "float8_e4m3fn")
        itemsize = 4 if name.endswith(".scale") else 1
        assert size == f"{int(np.prod(meta['shape'])) * itemsize / 2**10:,.1f} KiB"


def test_a_flax_models_hooks_are_quantised_on_the_device_too():
    """A user's Flax model (workers/flax/) with capture dtype float8_e4m3: each hook's
    values and scales are numpy's quantisation of the same step's float32 output."""
    from actx.workers.flax import step as flax_step
    from actx.workers.model import sharding
    from tests import flax_models

    model = flax_models.make_masked_decoder()
    rng = np.random.default_rng(0)
    ids = rng.integers(1, flax_models.VOCAB, (8, 12)).astype(np.int32)
    pos = np.broadcast_to(np.arange(12, dtype=np.int32), (8, 12)).copy()
    seg = np.ones((8, 12), np.int32)
    mesh = sharding.make_mesh(data=8, model=1)
    hooks = "blocks.*:output"
    exact = flax_step.make_flax_extract_fn(model, hooks, mesh, dtype="float32")(ids, pos, seg)
    fn = flax_step.make_flax_extract_fn(model, hooks, mesh, dtype="float8_e4m3")
    out = fn(ids, pos, seg)
    assert sorted(out) == fn.output_names == sorted(
        [*fn.hook_names, *(quantised.scale_array(h) for h in fn.hook_names)])
    for name in fn.hook_names:
        want_values, want_scale = quantised.quantise(np.asarray(exact[name]))
        np.testing.assert_array_equal(np.asarray(out[quantised.scale_array(name)]), want_scale)
        np.testing.assert_array_equal(np.asarray(out[name]).view(np.uint8),
                                      want_values.view(np.uint8))
