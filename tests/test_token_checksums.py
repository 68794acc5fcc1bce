"""The token arrays' chunk checksums (schemas.chunk_checksums): a changed byte of a
token chunk, or a lost object, fails its read instead of reading as other tokens or as
padding, and a token store an earlier actx wrote (chunks without a checksum) is read and
prepared again as stored.
The journeys that follow the advice after such damage (workers, verify) are in
tests/test_advice_followed.py."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from actx.pipeline import main as prepare_main
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import runspec
from actx.schemas import ts_context
from actx.schemas import uri
from tests.test_bos_rule import stored_documents


@pytest.fixture
def texts(tmp_path) -> str:
    path = tmp_path / "notes.jsonl"
    with open(path, "w") as f:
        for i in range(12):
            f.write(json.dumps({"id": f"n{i}", "text": f"note {i} " + "word " * (i % 7)}) + "\n")
    return str(path)


def _spec(tokenizer: str, texts: str) -> runspec.RunSpec:
    return runspec.RunSpec.from_dict({
        "name": "sums", "model": {"path": ""}, "tokenizer": {"path": tokenizer},
        "sources": [{"kind": "text", "paths": [texts]}],
        "packing": {"mode": "segmented", "seq_len": 16},
        "layout": {"rows_per_shard": 2, "partition_rows": 4, "codec": "none"}})


def _inner_codecs(run: str, name: str) -> list[str]:
    with open(os.path.join(run, "tokens", name, "zarr.json")) as f:
        sharding = json.load(f)["codecs"][0]
    return [c["name"] for c in sharding["configuration"]["codecs"]]


def _read(run: str, name: str) -> np.ndarray:
    return ts_context.open_array(layout.array_spec(
        uri.parse(run), layout.token_array_key(name))).read().result()


def _change_first_byte(path: str) -> None:
    with open(path, "r+b") as f:
        first = f.read(1)[0]
        f.seek(0)
        f.write(bytes([first ^ 1]))


def _as_an_earlier_actx_wrote(run: str, spec: runspec.RunSpec) -> None:
    """Each token array written again with the same values in the format before the chunk
    checksum (layout.ArrayLayout.specs' second spec)."""
    loc = uri.parse(run)
    for name in layout.TOKEN_ARRAYS:
        values = _read(run, name)
        shutil.rmtree(os.path.join(run, "tokens", name))
        array = layout.token_array(name, values.shape[0], spec.packing.seq_len, spec.layout)
        ts_context.open_array(array.specs(loc, create=True)[1]).write(values).result()


def test_a_changed_byte_fails_the_read_where_the_earlier_format_reads_other_tokens(
        qwen_tokenizer_dir, texts, tmp_path):
    spec = _spec(qwen_tokenizer_dir, texts)
    run = str(tmp_path / "run")
    prepare_main.run_prepare(spec, run)
    for name in layout.TOKEN_ARRAYS:
        assert _inner_codecs(run, name) == ["bytes", "crc32c"], name
    ids = _read(run, "input_ids")

    # The reference: the same byte changed in the earlier format reads as another token.
    earlier = str(tmp_path / "earlier")
    shutil.copytree(run, earlier)
    _as_an_earlier_actx_wrote(earlier, spec)
    assert _inner_codecs(earlier, "input_ids") == ["bytes"]
    _change_first_byte(os.path.join(earlier, "tokens", "input_ids", "c", "0", "0"))
    changed = _read(earlier, "input_ids")
    assert (changed != ids).sum() == 1 and changed[0, 0] == ids[0, 0] ^ 1

    _change_first_byte(os.path.join(run, "tokens", "input_ids", "c", "0", "0"))
    with pytest.raises(ValueError, match="DATA_LOSS.*[Dd]igest mismatch") as failed:
        _read(run, "input_ids")
    # `actx verify` says the error's first line, cut between words where it runs long
    # (tensorstore's repeats the array's whole spec).
    line = str(failed.value).splitlines()[0]
    said = errors.first_line(failed.value)
    assert len(line) > 200 and said.endswith(" ...") and len(said) <= 204
    assert line.startswith(said.removesuffix(" ...")) and "igest mismatch" in said
    assert line[len(said) - 4] in " ,;:", said  # the cut falls between words
    assert errors.first_line(TimeoutError()) == "TimeoutError"  # no words: its type
    # The other partition's object is whole and reads as written.
    rows = 4
    assert (ts_context.open_array(layout.array_spec(uri.parse(run), layout.token_array_key(
        "input_ids")))[rows:].read().result() == ids[rows:]).all()


def test_a_token_store_an_earlier_actx_wrote_is_prepared_again_as_stored(
        qwen_tokenizer_dir, texts, tmp_path):
    """Prepare again over a run with committed partitions whose token arrays have no chunk
    checksum (what `actx prepare --spec RUN/run.json` does after damage): the token store
    stays, opened with its own codecs (not refused for a codecs mismatch), and the same
    tokens are written into it."""
    spec = _spec(qwen_tokenizer_dir, texts)
    run = str(tmp_path / "run")
    prepare_main.run_prepare(spec, run)
    documents = stored_documents(run)
    _as_an_earlier_actx_wrote(run, spec)
    # Partition 0 committed: prepare keeps a committed run's token store (it lists
    # commits/ only; the marker's contents are the workers').
    marker = os.path.join(run, *layout.commit_key(0).split("/"))
    os.makedirs(os.path.dirname(marker))
    with open(marker, "w") as f:
        f.write("{}")
    os.remove(os.path.join(run, "tokens", "positions", "c", "1", "0"))  # damaged: gone

    prepare_main.run_prepare(spec, run)
    for name in layout.TOKEN_ARRAYS:
        assert _inner_codecs(run, name) == ["bytes"], name
    assert stored_documents(run) == documents
    fresh = str(tmp_path / "fresh")
    prepare_main.run_prepare(spec, fresh)
    for name in layout.TOKEN_ARRAYS:
        assert (_read(run, name) == _read(fresh, name)).all(), name


def test_a_lost_token_object_fails_the_read_where_the_earlier_format_reads_padding(
        qwen_tokenizer_dir, texts, tmp_path):
    """A token object deleted (or left out of a copy of the run): its rows would read as
    the fill values, token id 0 and segment id 0 (padding), that is tokens the model then
    runs on and documents that vanish. An array with chunk checksums stores every chunk,
    so its reads fail on a missing one instead, in actx's reader too."""
    import actx

    spec = _spec(qwen_tokenizer_dir, texts)
    run = str(tmp_path / "run")
    prepare_main.run_prepare(spec, run)
    earlier = str(tmp_path / "earlier")
    shutil.copytree(run, earlier)
    _as_an_earlier_actx_wrote(earlier, spec)
    for where in (run, earlier):
        for name in ("input_ids", "segment_ids"):
            os.remove(os.path.join(where, "tokens", name, "c", "1", "0"))
    rows = slice(4, 7)  # partition 1 (7 rows in all)
    assert not _read(earlier, "input_ids")[rows].any()  # the reference: silently fill
    assert not _read(earlier, "segment_ids")[rows].any()
    for name in ("input_ids", "segment_ids"):
        with pytest.raises(ValueError, match="NOT_FOUND.*is missing"):
            _read(run, name)
    with pytest.raises(ValueError, match="is missing"):
        actx.open_run(run).token_array("segment_ids")[rows].read().result()


def test_prepare_stores_a_chunk_of_fill_values(tmp_path):
    """tensorstore by default stores no chunk equal to the fill value (then read as
    missing, the strict read would fail on padding); a token array is written with every
    chunk stored."""
    from actx.pipeline import write_store
    from actx.schemas import run_dir

    spec = runspec.RunSpec.from_dict({
        "name": "fill", "model": {"path": ""}, "tokenizer": {"path": ""},
        "sources": [{"kind": "text", "paths": ["x.jsonl"]}],
        "packing": {"mode": "segmented", "seq_len": 16},
        "layout": {"rows_per_shard": 2, "partition_rows": 4}})
    run = run_dir.RunDir.at(str(tmp_path / "run"))
    array = write_store.open_token_array(run, "segment_ids", 8, spec)
    array[0:4].write(np.zeros((4, 16), np.int32)).result()  # padding alone: the fill value
    stored = ts_context.open_array(layout.array_spec(
        run.location, layout.token_array_key("segment_ids")))
    assert (stored[0:4].read().result() == 0).all()
    with pytest.raises(ValueError, match="is missing"):
        stored[4:8].read().result()  # never written: missing, not padding


def test_the_workers_name_a_lost_token_object_with_the_commands_that_finish_the_run(
        qwen_tokenizer_dir, texts, tmp_path):
    """The workers' token reads (workers.loop.prefetch): a lost object is damage to the
    token store, said in one line with the commands that write it again and go on; the
    journey that follows them is tests/test_advice_followed.py's (a changed byte)."""
    from actx.schemas import advice
    from actx.workers.loop import prefetch

    spec = _spec(qwen_tokenizer_dir, texts)
    run = str(tmp_path / "run")
    prepare_main.run_prepare(spec, run)
    os.remove(os.path.join(run, "tokens", "positions", "c", "1", "0"))
    tokens = prefetch.TokenStore(uri.parse(run))
    assert tokens.read_rows([0, 1, 3])["input_ids"].shape == (3, 16)  # partition 0 is whole
    with pytest.raises(prefetch.TokenStoreDamagedError) as raised:
        tokens.read_rows([3, 4])
    said = str(raised.value)
    assert f"{run}/tokens/positions" in said and "is missing" in said, said
    assert [kind for kind, _ in advice.find(said)] == ["reprepare", "rerun"], said


def test_preparing_a_committed_run_again_never_puts_other_tokens_under_its_activations(
        qwen_tokenizer_dir, texts, tmp_path, capsys):
    """A damaged token store's advice is to prepare the run again (`actx prepare --out RUN
    --spec RUN/run.json`: the same tokens). A fault audit followed it after an input had
    changed: the committed partitions' tokens were rewritten from the new input, under
    activations computed on the old ones, and every check passed; an input that lost a
    line failed with a raw tensorstore shape error. Now every committed partition is
    checked before anything is written, and only what cannot be read is written; tokens
    the inputs make otherwise, or rows that differ in number, are refused with what to do,
    the run as it was (its manifest too)."""
    from actx.schemas import run_dir, store

    spec = _spec(qwen_tokenizer_dir, texts)
    run = str(tmp_path / "run")
    prepare_main.run_prepare(spec, run)
    before = {name: _read(run, name) for name in layout.TOKEN_ARRAYS}
    s = store.open_store(run)
    for pid in (0, 1):  # committed: only listed names matter to prepare
        s.write_json(layout.commit_key(pid), {"partition": pid})
    again = ["--out", run, "--spec", os.path.join(run, "run.json")]

    # A damaged chunk of a committed partition, the inputs as they were: written again,
    # and nothing else of the committed partitions.
    victim = os.path.join(run, "tokens", "positions", "c", "0", "0")
    kept = os.path.join(run, "tokens", "input_ids", "c", "0", "0")
    _change_first_byte(victim)
    kept_at = os.stat(kept).st_mtime_ns
    assert prepare_main.main(again) == 0, capsys.readouterr().out
    assert all(np.array_equal(_read(run, n), v) for n, v in before.items())
    assert os.stat(kept).st_mtime_ns == kept_at
    # A lost object of a committed partition (a fault audit: it read as fill values,
    # taken for changed inputs, so the advice verify printed failed): written again too.
    os.remove(os.path.join(run, "tokens", "input_ids", "c", "1", "0"))
    assert prepare_main.main(again) == 0, capsys.readouterr().out
    assert all(np.array_equal(_read(run, n), v) for n, v in before.items())
    assert os.stat(kept).st_mtime_ns == kept_at

    # An input of partition 0 edited since (the same number of tokens), and partition 1's
    # chunk damaged: refused before any write (partition 1 is not written from the edited
    # inputs either), the run as it was.
    original = open(texts).read()
    with open(texts, "w") as f:
        f.write(original.replace('"note 0 ', '"note 9 ', 1))
    damaged = os.path.join(run, "tokens", "positions", "c", "1", "0")
    _change_first_byte(damaged)
    damaged_bytes = open(damaged, "rb").read()
    capsys.readouterr()
    assert prepare_main.main(again) == 2
    said = capsys.readouterr().out
    assert "partition p-00000 is committed, but the inputs now make other tokens" in said, said
    assert "Restore the inputs as they were when the run was prepared" in said, said
    assert open(damaged, "rb").read() == damaged_bytes
    assert np.array_equal(_read(run, "input_ids"), before["input_ids"])
    assert run_dir.open_run(run).committed() == {0, 1}  # its manifest put back

    # An input that lost lines: other rows in number, refused before any write.
    with open(texts, "w") as f:
        f.write("".join(original.splitlines(keepends=True)[:-4]))
    assert prepare_main.main(again) == 2
    said = capsys.readouterr().out
    assert "rows of tokens where the run, whose partitions are committed, holds" in said, said
    assert open(damaged, "rb").read() == damaged_bytes
    assert run_dir.open_run(run).committed() == {0, 1}

    with open(texts, "w") as f:  # the inputs restored: the damage written again
        f.write(original)
    assert prepare_main.main(again) == 0
    assert all(np.array_equal(_read(run, n), v) for n, v in before.items())


def test_a_token_store_an_earlier_actx_wrote_is_written_again_where_committed(
        qwen_tokenizer_dir, texts, tmp_path):
    """A run prepared before 0.3.0 (no chunk checksums): a lost chunk reads as fill values
    and cannot be told from a changed input, so prepare writes its committed partitions'
    tokens again as before (the review of the check above: it refused the run)."""
    from actx.schemas import store

    spec = _spec(qwen_tokenizer_dir, texts)
    run = str(tmp_path / "run")
    prepare_main.run_prepare(spec, run)
    before = {name: _read(run, name) for name in layout.TOKEN_ARRAYS}
    _as_an_earlier_actx_wrote(run, spec)
    store.open_store(run).write_json(layout.commit_key(0), {"partition": 0})
    os.remove(os.path.join(run, "tokens", "positions", "c", "0", "0"))
    assert prepare_main.main(["--out", run, "--spec", os.path.join(run, "run.json")]) == 0
    assert all(np.array_equal(_read(run, n), v) for n, v in before.items())
