"""Long documents: every token equals HF transformers run on its document alone.

Documents of 1, 2, 5 and 12 rows are packed (`segmented` and `pad`, overflow "continue")
together with short documents, run through the worker's own chain schedule and the cached
step, and every token of every hook is compared with HF on the document alone, from its
first token. Tokens past max_context are compared with HF on the whole document with a
sliding window of max_context (as `PackingSpec.max_context` defines them).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from actx.pipeline import pack
from actx.schemas import runspec
from tests import hf_models
from actx.workers.attention import dispatch as attention, xla as attention_xla
from actx.workers.loop import schedule
from actx.workers.model import capture, decoder as model_lib, step
from actx.workers.attention import ranged_flash_gpu, ranged_flash_tpu

SEQ_LEN = 8
HOOKS = "embed,layers.*.resid_pre,layers.*.attn_out,layers.*.resid_mid,layers.*.mlp_out," \
        "layers.*.resid_post,final_norm"


def _documents(seed: int, max_context: int) -> list[np.ndarray]:
    """1, 2, 5 and 12 rows long (12 rows is past max_context), between short documents."""
    rng = np.random.default_rng(seed)
    lengths = [3, 8, 5, 16, 2, 37, 6, 1, 90, 4, 7, 13]
    assert 90 > max_context
    return [rng.integers(1, 500, n).astype(np.int32) for n in lengths]


def _packed(docs, packing):
    plan = pack.plan_pack([len(d) for d in docs], packing)
    block = {n: np.full((plan.total_rows, packing.seq_len), -1, np.int32)
             for n in ("input_ids", "segment_ids", "positions", "doc_index", "context_start")}
    for n in ("input_ids", "segment_ids", "positions"):
        block[n][:] = 0
    for d, ids in enumerate(docs):
        pack.fill_rows(block, 0, plan.pieces[d], ids, d, packing=packing)
    return block


def run_rows(fn, block, local_batch: int) -> dict[str, np.ndarray]:
    """Runs every row through the worker's chain schedule; returns hook -> [rows, t, d]."""
    seg, pos = block["segment_ids"], block["positions"]
    n_rows = seg.shape[0]
    continues_row = (seg[:, 0] > 0) & (pos[:, 0] > 0)
    steps = schedule.assign(schedule.chains(0, n_rows, continues_row), local_batch, 0)
    out: dict[str, np.ndarray] = {}
    for s in steps:
        rows = list(s.rows)
        acts = fn(block["input_ids"][rows], pos[rows], seg[rows],
                  continues=np.asarray(s.continues))
        for name, values in acts.items():
            values = np.asarray(values, np.float32)
            buf = out.setdefault(name, np.zeros((n_rows,) + values.shape[1:], np.float32))
            for j, row in enumerate(rows):
                if s.write[j]:
                    buf[row] = values[j]
    return out


def assert_documents_match_hf(stored, block, docs, hf, max_context, rtol):
    """Every token of every document vs HF on the document alone (band masks past each
    layer's window: `hf_models.context_mask`)."""
    checked = 0
    for d, ids in enumerate(docs):
        where = np.nonzero(block["doc_index"] == d)
        order = np.argsort(block["positions"][where])
        rows, cols = where[0][order], where[1][order]
        assert list(block["input_ids"][rows, cols]) == list(ids)
        ref = hf_models.hf_hooks(hf, ids[None], attention_mask=hf_models.context_mask(
            hf, len(ids), max_context))
        for name, values in stored.items():
            got, want = values[rows, cols], ref[name][0]
            err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
            assert err <= rtol, f"doc {d} ({len(ids)} tokens), {name}: relative L2 {err:.2e}"
            checked += 1
    assert checked == len(docs) * len(stored)


@pytest.mark.parametrize("arch,mode,overrides,max_context,query_chunk", [
    ("qwen2", "segmented", {}, 24, None),
    ("qwen2", "pad", {}, 24, None),
    ("qwen2", "segmented", {}, 20, None),  # not a multiple of seq_len: the cache holds more
    ("llama3", "segmented", {}, 24, None),
    ("mistral", "segmented", {"sliding_window": 12}, 24, None),
    # Qwen3's q/k norms; Gemma's local layers (window 12) beside global ones (max_context),
    # Gemma 3's two RoPE bases, and the text tower of a multimodal Gemma 3 checkpoint.
    ("qwen3", "segmented", {}, 24, None),
    ("gemma2", "segmented", {}, 24, None),
    ("gemma3", "segmented", {}, 24, None),
    ("gemma3_mm", "pad", {}, 20, None),
    # Queries in chunks of 3, 3 and 2 (rows of 1024 tokens go in 8 chunks of 128): each
    # chunk sees only the row's keys up to its last query, and skips the cache where none
    # of its queries continues a document; the oldest cached block it reaches into is
    # visited in pieces of 2 keys (rows of 1024: 256), only those its queries reach.
    ("qwen2", "segmented", {}, 20, 3),
    ("mistral", "segmented", {"sliding_window": 12}, 24, 3),
])
def test_every_token_matches_hf_on_its_document_alone(tmp_path, monkeypatch, arch, mode,
                                                      overrides, max_context, query_chunk):
    if query_chunk:
        monkeypatch.setattr(attention_xla, "MIN_QUERY_CHUNK", query_chunk)
        monkeypatch.setattr(attention_xla, "MIN_PIECE", 2)
        assert attention_xla.query_chunks(SEQ_LEN) == [(0, 3), (3, 6), (6, 8)]
        assert attention_xla.block_piece(SEQ_LEN) == 2
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path, dtype="float32")
    spec = capture.CaptureSpec.parse(HOOKS, dtype="float32")
    fn = step.make_extract_fn(model, spec, max_context=max_context)
    docs = _documents(0, max_context)
    packing = runspec.PackingSpec(mode, SEQ_LEN, max_context=max_context)
    block = _packed(docs, packing)
    stored = run_rows(fn, block, local_batch=3)
    assert_documents_match_hf(stored, block, docs, hf, max_context, rtol=1e-5)
    assert fn.compile_count() == 1


ACCELERATOR_CASES = [
    ("qwen2", "segmented", {}, 24),
    ("qwen2", "pad", {}, 24),
    ("qwen2", "segmented", {}, 20),
    ("llama3", "segmented", {}, 24),
    ("mistral", "segmented", {"sliding_window": 12}, 24),
    ("gemma2", "segmented", {}, 24),  # soft-capped logits in the kernels
]


def _use_way(monkeypatch, way: str) -> str:
    """Routes the step through one accelerator way, run here on the CPU; returns the
    attention implementation to ask for."""
    if way == "all slots":
        monkeypatch.setattr(attention, "default_slots_per_visit", lambda batch, shards: batch)
        return "xla"
    if way == "fused":
        monkeypatch.setattr(attention, "_cudnn", lambda q, k, v, mask, scale: (
            jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                         implementation="xla")))
        return "cudnn"
    # Tiles of 4 tokens: each row of 8 is two key tiles, the ring several.
    monkeypatch.setattr(ranged_flash_gpu, "MAX_TILE", 4)
    monkeypatch.setattr(ranged_flash_tpu, "MAX_TILE", 4)
    return way


XLA_ELSEWHERE_CASES = [ACCELERATOR_CASES[i] for i in (0, 2, 4)]


@pytest.mark.parametrize("way,arch,mode,overrides,max_context",
                         [(way, *case) for way in ("pallas_gpu", "pallas_tpu")
                          for case in ACCELERATOR_CASES]
                         + [(way, *case) for way in ("all slots", "fused")
                            for case in XLA_ELSEWHERE_CASES])
def test_the_accelerator_ways_match_hf(tmp_path, monkeypatch, way, arch, mode, overrides,
                                       max_context):
    """The ways GPUs and TPUs take through the cache, run here on the CPU: XLA block
    visits with every slot at once (XLA off the CPU), one attention over the cache and the
    row together (the formulation cuDNN runs), and the Pallas kernels over per-query key
    intervals (in Pallas interpret mode), for every case the CPU's way is tested on (the
    two XLA formulations, which the CPU's way shares its code with, on three of them)."""
    impl = _use_way(monkeypatch, way)
    path = hf_models.make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path, dtype="float32")
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(
        "layers.*.resid_post,final_norm", dtype="float32"), max_context=max_context,
        attention_impl=impl)
    docs = _documents(0, max_context)
    block = _packed(docs, runspec.PackingSpec(mode, SEQ_LEN, max_context=max_context))
    stored = run_rows(fn, block, local_batch=3)
    assert_documents_match_hf(stored, block, docs, hf, max_context, rtol=1e-5)


@pytest.mark.parametrize("arch,way", [("qwen2", "xla"), ("qwen2", "pallas_gpu"),
                                      ("qwen2", "pallas_tpu"), ("gemma2", "pallas_tpu"),
                                      ("gemma3", "xla")])
def test_bfloat16_matches_hf_within_bf16_tolerance(tmp_path, monkeypatch, arch, way):
    impl = _use_way(monkeypatch, way) if way != "xla" else "xla"
    path = hf_models.make_tiny_checkpoint(tmp_path / "q", arch)
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path, dtype="bfloat16")
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse(
        "layers.*.resid_post", dtype="float32"), max_context=24, attention_impl=impl)
    docs = _documents(1, 24)
    block = _packed(docs, runspec.PackingSpec("segmented", SEQ_LEN, max_context=24))
    stored = run_rows(fn, block, local_batch=4)
    assert_documents_match_hf(stored, block, docs, hf, 24, rtol=2e-2)


def test_rows_seen_alone_differ_from_hf_so_the_check_can_fail(tmp_path):
    """Today's old behaviour (every row computed as if its document started there) is
    caught by the same comparison: the continuation rows differ from HF."""
    path = hf_models.make_tiny_checkpoint(tmp_path / "q", "qwen2")
    hf = hf_models.load_hf_model(path)
    model = model_lib.load_pretrained(path, dtype="float32")
    fn = step.make_extract_fn(model, capture.CaptureSpec.parse("layers.2.resid_post",
                                                               dtype="float32"))
    docs = _documents(2, 24)
    block = _packed(docs, runspec.PackingSpec("segmented", SEQ_LEN, max_context=24))
    stored = {"layers.2.resid_post": np.asarray(fn(
        block["input_ids"], block["positions"], block["segment_ids"])["layers.2.resid_post"])}
    with pytest.raises(AssertionError, match="relative L2"):
        assert_documents_match_hf(stored, block, docs, hf, 24, rtol=1e-5)


@pytest.mark.parametrize("way", ["xla", "pallas_gpu", "pallas_tpu"])
def test_a_slot_that_starts_another_document_forgets_the_last_one(tmp_path, monkeypatch,
                                                                  way):
    """Two different schedules (batch 1: every chain through one slot; batch 5) give the
    same activations: nothing of one document leaks into the next one in the slot.

    Bit for bit on the CPU. On an H100 the two batch sizes differ in the last bits (through
    the cache, and at full matmul precision even rows computed alone), since the GPU's
    matmuls pick their algorithm by shape (bench/RESULTS.md, "GPU"): that is why the
    numerics a run records include the rows per device."""
    impl = _use_way(monkeypatch, way) if way != "xla" else "xla"
    path = hf_models.make_tiny_checkpoint(tmp_path / "q", "qwen2")
    model = model_lib.load_pretrained(path, dtype="float32")
    spec = capture.CaptureSpec.parse("layers.*.resid_post", dtype="float32")
    docs = _documents(3, 24)
    block = _packed(docs, runspec.PackingSpec("segmented", SEQ_LEN, max_context=24))
    one = run_rows(step.make_extract_fn(model, spec, max_context=24, attention_impl=impl),
                   block, 1)
    five = run_rows(step.make_extract_fn(model, spec, max_context=24, attention_impl=impl),
                    block, 5)
    for name in one:  # bit for bit: a slot's bytes never depend on the other slots
        np.testing.assert_array_equal(one[name], five[name])



def test_a_row_whose_document_the_cache_does_not_hold_is_refused(tmp_path):
    """The Python API's cached step: a slot's cache carries only the document that began
    its row and filled it. A row flagged as continuing a document that started mid-row
    (B after A's end) would attend to A's keys (before: accepted, 0.78 max relative error
    against HF on qwen2); it is refused naming the slot, with nothing computed. Rows as
    actx packs them (A over whole rows) pass, and match HF."""
    path = hf_models.make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model = model_lib.load_pretrained(path, dtype="float32")
    spec = capture.CaptureSpec.parse("layers.*.resid_post", dtype="float32")
    fn = step.make_extract_fn(model, spec, max_context=64)
    hf = hf_models.load_hf_model(path)
    rng = np.random.default_rng(3)
    a, b = (rng.integers(1, 500, n).astype(np.int32) for n in (40, 20))
    seq = 16

    def row(pieces):
        """One row of (document ids, first position) pieces, padded to seq."""
        ids, pos, seg = (np.zeros(seq, np.int32) for _ in range(3))
        at = 0
        for s, (doc, start, n) in enumerate(pieces, 1):
            ids[at:at + n], pos[at:at + n] = doc[start:start + n], np.arange(start, start + n)
            seg[at:at + n] = s
            at += n
        return ids, pos, seg

    def call(rows, continues):
        ids, pos, seg = (np.stack(x) for x in zip(*rows))
        return fn(ids, pos, seg, continues=np.asarray(continues))

    out = []
    for r, flag in ((row([(a, 0, 16)]), False), (row([(a, 16, 16)]), True)):
        out.append(call([r, r], [flag, flag])["layers.1.resid_post"])
    call([row([(a, 32, 8), (b, 0, 8)])] * 2, [True, True])
    with pytest.raises(ValueError, match=r"continues\[0\]: slot 0's row starts with "
                                         r"position 8 of segment 1, but its previous row's "
                                         r"first document ended inside that row"):
        call([row([(b, 8, 12)])] * 2, [True, True])
    ref = hf_models.hf_hooks(hf, a[None])["layers.1.resid_post"][0]
    got = np.concatenate([np.asarray(o)[0] for o in out])
    assert np.abs(got - ref[:32]).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    # A continued row at the wrong position, after a row its document filled: refused.
    call([row([(a, 0, 16)])] * 2, [False, False])
    with pytest.raises(ValueError, match=r"continues at position 16"):
        call([row([(a, 20, 16)])] * 2, [True, True])
