"""Token masks (reader.masks): each reason against an independent computation, and the
`exclude=` of select, batches and stream."""

import dataclasses
import json
import os

import numpy as np
import pytest

from actx import reader
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import store as store_lib
from actx.schemas import ts_context
from tests import reader_fixtures as rf

T = 16
HOOK = "embed"


def _flat_select(run, **kwargs) -> np.ndarray:
    sel = run.select(HOOK, **kwargs)
    return np.sort(sel.rows * T + sel.cols)


def _flat_batches(batches) -> np.ndarray:
    return np.sort(np.concatenate([np.asarray(b.rows) * T + np.asarray(b.cols)
                                   for b in batches]))


def _all_readers_keep(run, want: np.ndarray, **kwargs) -> None:
    """select, batches and stream with the same exclusions return exactly `want` (flat
    positions, ascending) once per epoch."""
    want = np.flatnonzero(want)
    assert np.array_equal(_flat_select(run, **kwargs), want)
    assert np.array_equal(_flat_batches(run.batches(HOOK, 5, drop_last=False, **kwargs)), want)
    with run.stream(HOOK, 5, buffer_tokens=4 * T, block_rows=4, drop_last=False,
                    **kwargs) as s:
        assert np.array_equal(_flat_batches(s), want)


def _write_tokens(uri: str, name: str, values: np.ndarray) -> None:
    ts_context.open_array(layout.array_spec(store_lib.open_store(uri).location,
                                            layout.token_array_key(name))).write(values).result()


def _doc_starts(truth: rf.RunTruth) -> np.ndarray:
    """[rows, T]: the first token of every document, from the doc table."""
    first = np.zeros(truth.tokens["input_ids"].shape, bool)
    for d in truth.docs:
        first[d["first_row"], d["first_col"]] = True
    return first


def _qwen_special_ids(tokenizer_dir: str) -> list[int]:
    """The special tokens as tokenizer.json lists them (read as JSON, not through any
    tokenizer library)."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        return [t["id"] for t in json.load(f)["added_tokens"] if t["special"]]


def test_special_mask_uses_the_tokenizers_special_ids(tmp_path, qwen_tokenizer_dir):
    from actx.pipeline import tokenize  # how prepare records them in the manifest

    truth = rf.build_run(str(tmp_path / "run"), committed=(0, 1))
    special = _qwen_special_ids(qwen_tokenizer_dir)
    assert len(special) > 2
    ids = truth.tokens["input_ids"].copy()
    rng = np.random.default_rng(3)
    valid = truth.committed_mask()
    at = rng.choice(np.flatnonzero(valid), 40, replace=False)
    ids.reshape(-1)[at] = rng.choice(special, 40)
    _write_tokens(truth.uri, "input_ids", ids)
    store = store_lib.open_store(truth.uri)
    old = manifest_lib.read_manifest(store)
    loaded = tokenize.load_tokenizer(qwen_tokenizer_dir)
    manifest_lib.write_manifest(store, dataclasses.replace(
        old, special_token_ids=loaded.special_token_ids, bos_id=None))
    run = reader.open_run(truth.uri)
    want = valid & ~np.isin(ids, special)
    assert (valid & ~want).sum() >= 40
    _all_readers_keep(run, want, exclude=["special"])


@pytest.mark.parametrize("packing", ["segmented", "concat"])
def test_bos_and_doc_boundary_masks(tmp_path, packing):
    truth = rf.build_run(str(tmp_path / "run"), packing=packing, committed=(0, 1))
    ids = truth.tokens["input_ids"].copy()
    first = _doc_starts(truth)
    # Some documents open without BOS: their first token is left out all the same.
    plain_first = np.flatnonzero(first)[::3]
    ids.reshape(-1)[plain_first] = 500
    _write_tokens(truth.uri, "input_ids", ids)
    valid = truth.committed_mask()
    run = reader.open_run(truth.uri)
    _all_readers_keep(run, valid & ~first & (ids != rf.BOS_ID), exclude=["bos"])

    # doc_boundary: in concat rows the stream runs on across documents, so each document
    # that starts inside a row (column > 0) makes a boundary: its first token and the
    # token before it. Segmented rows keep documents apart: no boundary.
    boundary = np.zeros(ids.shape, bool)
    if packing == "concat":
        for d in truth.docs:
            if d["first_col"] > 0:
                boundary[d["first_row"], d["first_col"] - 1:d["first_col"] + 1] = True
        assert (boundary & valid).sum() > 10
    _all_readers_keep(run, valid & ~boundary, exclude=["doc_boundary"])
    _all_readers_keep(run, valid & ~boundary & ~first & (ids != rf.BOS_ID),
                      exclude=["doc_boundary", "bos", "padding"])


def _with_outliers(tmp_path, packing="segmented"):
    truth = rf.build_run(str(tmp_path / "run"), committed=(0, 1), random_values=True,
                         packing=packing)
    loc = store_lib.open_store(truth.uri).location
    arr = ts_context.open_array(layout.array_spec(loc, layout.activation_array_key(HOOK)))
    values = arr.read().result()
    valid = truth.committed_mask()
    rng = np.random.default_rng(7)
    big = rng.choice(np.flatnonzero(valid), 12, replace=False)
    flat = values.reshape(-1, values.shape[-1])
    flat[big] *= rng.uniform(30, 300, (12, 1)).astype(np.float32)
    arr.write(values).result()
    return truth, valid, big


def test_outlier_mask_against_norms_recomputed_from_the_stored_arrays(tmp_path):
    truth, valid, big = _with_outliers(tmp_path)
    run = reader.open_run(truth.uri)
    with pytest.raises(reader.ReaderError, match="compute_stats"):
        run.select(HOOK, exclude=["outlier"])
    stats = run.compute_stats()[HOOK]
    stored = run.rows(HOOK, 0, 16).astype(np.float64)  # partitions 0 and 1
    norms = np.zeros(valid.shape)
    norms[:16] = np.linalg.norm(stored, axis=-1)
    median = np.median(norms[valid])
    assert abs(stats.norm_median / median - 1) < 0.003  # the histogram's bin width
    np.testing.assert_allclose(stats.mean_norm, norms[valid].mean(), rtol=1e-6)
    outlier = valid & (norms > 10 * stats.norm_median)
    assert set(np.flatnonzero(outlier)) == set(big.tolist())  # the scaled tokens, no others
    _all_readers_keep(run, valid & ~outlier, exclude=["outlier"])
    # Another factor: the limit moves with it.
    outlier_50 = valid & (norms > 50 * stats.norm_median)
    assert 0 < outlier_50.sum() < outlier.sum()
    assert np.array_equal(_flat_select(run, exclude=["outlier"], outlier_factor=50),
                          np.flatnonzero(valid & ~outlier_50))
    # The stored norms are the stored activations' norms.
    loc = run.location
    stored_norms = ts_context.open_array(layout.array_spec(
        loc, layout.norms_array_key(HOOK))).read().result()
    np.testing.assert_allclose(stored_norms[valid], norms[valid], rtol=1e-5)


def test_describe_counts_what_each_mask_removes(tmp_path):
    truth, valid, big = _with_outliers(tmp_path, packing="concat")
    run = reader.open_run(truth.uri)
    assert run.describe()["masks"] is None
    run.compute_stats()
    masks = run.describe()["masks"]
    ids = truth.tokens["input_ids"]
    committed_rows = np.zeros(valid.shape, bool)
    committed_rows[:16] = True
    first = _doc_starts(truth) & valid
    boundary = np.zeros(ids.shape, bool)
    for d in truth.docs:
        if d["first_col"] > 0:
            boundary[d["first_row"], d["first_col"] - 1:d["first_col"] + 1] = True
    assert masks["partitions"] == [0, 1] and masks["positions"] == 16 * T
    assert masks["removed"] == {
        "special": int((valid & np.isin(ids, rf.SPECIAL_IDS)).sum()),
        "bos": int((first | (valid & (ids == rf.BOS_ID))).sum()),
        "padding": int((committed_rows & ~valid).sum()),
        "doc_boundary": int((boundary & valid).sum())}
    assert masks["outlier"]["embed"] == len(big)
    assert masks["outlier_factor"] == 10.0


def test_unknown_mask_name_is_refused_with_the_known_names(reader_run):
    run = reader.open_run(reader_run.uri)
    with pytest.raises(ValueError, match="unknown mask 'boss'; known: special, bos"):
        run.batches(HOOK, 4, exclude=["boss"])


def test_status_and_the_page_show_what_each_mask_removes(tmp_path):
    """`actx status` (text and --json) and the live page report the counts compute_stats
    stored, the same as describe(); before compute_stats they say none were counted."""
    import io

    from actx.deploy import cli
    from tests import browser

    truth, _, _ = _with_outliers(tmp_path, packing="concat")
    out = io.StringIO()
    assert cli.main(["status", truth.uri, "--json"], out=out) == 0
    assert json.loads(out.getvalue())["token_masks"] is None
    run = reader.open_run(truth.uri)
    run.compute_stats()
    want = run.describe()["masks"]
    out = io.StringIO()
    assert cli.main(["status", truth.uri, "--json"], out=out) == 0
    assert json.loads(out.getvalue())["token_masks"] == want
    out = io.StringIO()
    assert cli.main(["status", truth.uri], out=out) == 0
    line = next(li for li in out.getvalue().splitlines() if li.startswith("masks:"))
    for name, n in want["removed"].items():
        assert f"{name} {n:,}" in line
    assert f"outlier in embed {want['outlier']['embed']:,}" in line
    page_path = str(tmp_path / "page.html")
    assert cli.main(["status", truth.uri, "--html", page_path], out=io.StringIO()) == 0
    browser.require_chromium()
    page = browser.Elements(browser.dump_dom(f"file://{page_path}"))
    for name, n in want["removed"].items():
        assert page.text(f"data-mask={name}").split()[:2] == [name, f"{n:,}"]
    assert page.text("data-mask=outlier:embed").split()[-2] == f"{want['outlier']['embed']:,}"
    assert page.text("masks-positions").startswith(f"of {want['positions']:,} token positions")
