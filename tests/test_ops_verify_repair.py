"""`actx verify` on an incomplete run names the uncommitted partitions and exits 1 unless
`--committed-only`; `--repair` turns a partition whose stored data is damaged back into
pending (its marker deleted and recorded), and `actx rerun` then restores the bytes an
undamaged run holds. Real worker processes on a tiny random Qwen2."""

from __future__ import annotations

import io
import json
import os

from actx.deploy import cli
from actx.schemas import commit, layout, store
from tests import hf_models, token_runs

HOOK = "layers.0.resid_post"


def _cli(*argv):
    out = io.StringIO()
    return cli.main(list(argv), out=out), out.getvalue()


def _objects(run):
    root = os.path.join(run, "activations", HOOK)
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files if f != "zarr.json"}


def test_verify_incomplete_then_repair_and_rerun(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4, hooks=HOOK)  # 3 partitions
    s = store.open_store(run)
    code, out = _cli("rerun", run, "--only", "0,2", "--hosts", "1", "--batch-size", "4")
    assert code == 0, out

    # p-00001 is not committed: named, and a failure unless only committed ones count.
    code, out = _cli("verify", run)
    assert code == 1 and "OK: every committed block matches its checksum" in out
    assert (f"INCOMPLETE: 1 partition(s) not committed: p-00001; `actx rerun {run}` "
            f"extracts them") in out
    code, out = _cli("verify", run, "--json")
    assert code == 1 and json.loads(out)["not_committed"] == ["p-00001"]
    assert not json.loads(out)["complete"]
    assert _cli("verify", run, "--committed-only")[0] == 0

    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code == 0, out
    assert _cli("verify", run)[0] == 0
    reference = _objects(run)  # what an undamaged run holds (reruns rewrite identical bytes)

    # Damage one stored object of p-00002 (rows 16-19): flip its first byte.
    victim = os.path.join(run, "activations", HOOK, "c", "4", "0", "0")
    with open(victim, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    code, out = _cli("verify", run)
    assert code == 1 and "partition p-00002" in out and "--repair" in out
    marker = s.read_json(layout.commit_key(2))
    # The reader says so on open (it served such a partition's values as they were: an
    # object removed read as zeros), naming the partition and the commands, as printed.
    import pytest

    import actx
    from actx.reader import errors as reader_errors

    with pytest.warns(reader_errors.FailedVerificationWarning) as said:
        opened = actx.open_run(run)
    words = str(said[0].message)
    assert "found 1 committed partition(s) whose data is not what their markers say " \
           "(p-00002)" in words, words
    assert f"`actx verify {run} --repair` turns them back into pending, then " \
           f"`actx rerun {run}` extracts them again" in words, words
    assert opened.describe()["failed_verification"] == [2]
    phase = next(line for line in _cli("status", run)[1].splitlines()
                 if line.startswith("phase:"))  # "finished" alone would read as done
    assert phase.endswith("every partition is committed; but 1 of them failed the latest "
                          "`actx verify` (below)"), phase

    code, out = _cli("verify", run, "--repair")
    assert code == 1
    assert "REPAIRED: 1 partition(s) are pending again" in out and "p-00002" in out
    assert commit.committed_partitions(s) == {0, 1}
    [record_key] = s.list(layout.VERIFY_REPAIRS_PREFIX)
    record = s.read_json(record_key)
    assert record["partitions"] == ["p-00002"] and record["markers"]["p-00002"] == marker
    assert any("p-00002" in p for p in record["problems"])
    st = json.loads(_cli("status", run, "--json")[1])
    assert st["partitions"]["p-00002"] == "pending" and st["failed_verification"] == []

    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code == 0 and "rerun: 1 partition(s) on local: p-00002" in out, out
    assert _cli("verify", run)[0] == 0
    assert _objects(run) == reference
    st = json.loads(_cli("status", run, "--json")[1])
    assert st["complete"] and st["failed_verification"] == []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", reader_errors.FailedVerificationWarning)
        assert actx.open_run(run).describe()["failed_verification"] == []

    # The verify record damaged (a fault audit truncated it): status, rerun and verify
    # itself stopped with exit 2, and the reader took it for no failure. Now what it found
    # is unknown, said as such with the command that writes it anew, which passes.
    path = os.path.join(run, layout.VERIFY_RECORD_KEY)
    with open(path, "r+b") as f:
        f.truncate(20)
    code, out = _cli("status", run)
    [line] = [x for x in out.splitlines() if x.startswith("verify:")]
    assert line.startswith(f"verify:     unknown: the record of the latest verify is "
                           f"damaged ({path}: not valid JSON"), line
    assert line.endswith(f"which committed partitions it found failing cannot be told; "
                         f"`actx verify {run}` checks them again and writes it anew"), line
    assert code == 0 and _cli("status", run, "--check")[0] == 1  # complete: not known
    with pytest.warns(reader_errors.FailedVerificationWarning, match="cannot be told"):
        actx.open_run(run)
    assert _cli("rerun", run, "--hosts", "1", "--batch-size", "4")[0] == 0
    code, out = _cli("verify", run)  # as printed
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    assert _cli("status", run, "--check")[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", reader_errors.FailedVerificationWarning)
        actx.open_run(run)


def test_an_array_that_cannot_be_read_fails_every_partition_and_the_advice_restores_it(
        tmp_path):
    """Found by a fault audit: a hook's whole array removed (or its zarr.json damaged) was
    a verify problem tied to no partition, so status said the verify passed, `--repair`
    repaired nothing and `actx rerun` found nothing to do: the advice went in circles.
    Such an array fails every committed partition; `--repair` deletes what cannot serve
    (a damaged zarr.json), and the rerun writes the same bytes again."""
    import shutil

    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=16, seq_len=16, partition_rows=8,
                               rows_per_shard=4, hooks=HOOK)  # 2 partitions
    assert _cli("rerun", run, "--hosts", "1", "--batch-size", "4")[0] == 0
    reference = _objects(run)
    metadata = os.path.join(run, "activations", HOOK, "zarr.json")
    s = store.open_store(run)
    for damage in ("removed", "zarr.json damaged"):
        if damage == "removed":
            shutil.rmtree(os.path.join(run, "activations", HOOK))
        else:
            with open(metadata, "w") as f:
                f.write("{not json")
        import pytest

        import actx

        with pytest.raises(FileNotFoundError) as refused:  # the reader names what helps
            actx.open_run(run).hooks
        assert f"`actx verify {run}` names what is wrong, `actx verify {run} --repair` then " \
               f"`actx rerun {run}` writes it again" in str(refused.value), refused.value
        assert "tensorstore_spec" not in str(refused.value)
        code, out = _cli("verify", run)
        assert code == 1 and f"array {HOOK}: cannot be opened" in out, out
        assert "--repair` turns the failed partitions back into pending" in out, out
        st = json.loads(_cli("status", run, "--json")[1])
        assert st["failed_verification"] == ["p-00000", "p-00001"], (damage, st)
        assert _cli("status", run, "--check")[0] != 0
        code, out = _cli("verify", run, "--repair")
        assert "REPAIRED: 2 partition(s) are pending again" in out, out
        assert commit.committed_partitions(s) == set()
        assert not os.path.exists(metadata)  # a damaged one deleted: the rerun writes it
        said = _cli("status", run)[1]
        assert "its 2 failed partition(s) were repaired" in said, said
        code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
        assert code == 0, out
        assert _cli("verify", run)[0] == 0
        assert _objects(run) == reference
        said = _cli("status", run)[1]
        assert "verify:     passed at" in said, said
    [first, second] = sorted(s.list(layout.VERIFY_REPAIRS_PREFIX))
    assert "metadata" not in s.read_json(first)  # nothing was there to delete
    assert s.read_json(second)["metadata"] == {
        f"activations/{HOOK}/zarr.json": {"unreadable": "{not json"}}


def test_tokens_changed_after_the_extraction_fail_their_partition_until_it_is_extracted_again(
        tmp_path):
    """Each commit marker records the tokens its activations were computed on
    (token_checksums). A token store changed after the extraction with every chunk still
    readable (prepared again from edited inputs where a chunk was lost, an older copy put
    back) left activations under other tokens, and every check passed: verify now fails
    that partition, naming the token array and rows; --repair and a rerun extract it from
    the tokens stored, and it verifies."""
    import numpy as np

    from actx.schemas import ts_context, uri
    from tests import worker_procs

    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4, hooks=HOOK)  # 3 partitions
    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code == 0, out
    assert _cli("verify", run)[0] == 0

    # Rows 12-15 (p-00001's second block) of input_ids: other ids, stored readable.
    ids = ts_context.open_array(layout.array_spec(uri.parse(run),
                                                  layout.token_array_key("input_ids")))
    changed = np.asarray(ids[12:16].read().result())
    changed[changed > 0] = changed[changed > 0] % 7 + 1
    ids[12:16].write(changed).result()

    code, out = _cli("verify", run, "--json")
    report = json.loads(out)
    assert code == 1 and report["failed"] == ["p-00001"] and report["tokens_damaged"] == []
    code, out = _cli("verify", run)
    assert code == 1
    assert ("partition p-00001: its activations were computed on other tokens than the token "
            "store holds (input_ids, block 1, rows 12-15") in out, out
    assert f"actx verify {run} --repair" in out, out
    code, out = _cli("verify", run, "--repair")
    assert code == 1 and "p-00001" in out
    code, out = _cli("rerun", run, "--hosts", "1", "--batch-size", "4")
    assert code == 0 and "p-00001" in out, out
    assert _cli("verify", run)[0] == 0
    assert worker_procs.assert_markers_record_the_tokens(run) == 3


def test_an_array_the_store_refuses_to_open_fails_no_partition_and_verify_again_passes(
        gcs_emulator_server):
    """Found by a fault audit: a hook's array that the store would not open this once (a
    refusal, an outage past the retries; its zarr.json reads fine) is a problem of no
    partition, yet verify advised `--repair`, which turns nothing back, and the rerun
    after it found nothing to do. It now names `actx verify RUN` again, and that, once
    the store answers, passes."""
    import re
    import subprocess
    import sys

    from tests import fault_proxy, reader_fixtures

    run = gcs_emulator_server.create_bucket("actx-verify-refused") + "/runs/r"
    reader_fixtures.build_run(run, num_partitions=2, committed=(0, 1))
    proxy = fault_proxy.FaultProxy(gcs_emulator_server.url).start()
    refused = "activations/embed/zarr.json"
    proxy.add_rule("403", lambda r: r.agent == "tensorstore" and r.object_name.endswith(
        refused), times=None)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo, "STORAGE_EMULATOR_HOST": proxy.url,
           "TENSORSTORE_GCS_HTTP_URL": proxy.url}

    def verify():
        proc = subprocess.run([sys.executable, "-m", "actx.deploy.cli", "verify", run],
                              cwd=repo, env=env, capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout  # stderr: tensorstore's log lines

    try:
        code, out = verify()
        assert code == 1 and "array embed: cannot be opened" in out, out
        assert "--repair" not in out, out
        advice = re.findall(r"`(actx [^`]*)`", out.rstrip().splitlines()[-1])
        assert advice == [f"actx verify {run}"], out
        said = _cli("status", run)[1]  # the latest verify did not pass
        assert "verify:     FAILED at" in said and "no partition failed its check" in said, said
        assert f"`actx verify {run}`" in said, said
        proxy.configure(rules=False)  # the store answers again
        code, out = verify()
        assert code == 0 and "OK: every committed block matches its checksum" in out, out
        said = _cli("status", run)[1]
        assert "verify:     passed at" in said, said
    finally:
        proxy.stop()
