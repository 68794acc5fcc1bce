"""Temporary files of marker writes (issue 66, item 9): a worker killed between writing
`commits/p-NNNNN.json.tmp-<id>` and moving it in place leaves it behind. It is never read
(status and verify count markers only, whatever it holds), the next commit of that
partition removes it, `actx verify` names leftovers and `--repair` removes them. Real
worker processes on a tiny random Qwen2."""

from __future__ import annotations

import io
import json
import os

from actx.deploy import cli
from actx.schemas import commit, layout, store
from tests import hf_models, token_runs


def _leftover(run: str, partition: int, tag: str) -> str:
    """What a kill mid-write leaves: a temporary beside the marker, cut short."""
    path = os.path.join(run, layout.commit_key(partition) + f".tmp-{tag}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write('{"partition": ')
    return path


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(list(argv), out=out), out.getvalue()


def test_leftover_marker_temporaries_are_never_read_and_are_cleaned(tmp_path):
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4)  # 3 partitions
    code, said = _cli("rerun", run, "--only", "0,1", "--batch-size", "4")
    assert code == 0, said
    s = store.open_store(run)
    kept = _leftover(run, 0, "0123abcd")      # beside a standing marker
    redone = _leftover(run, 2, "4567ef01")    # of a partition not committed yet
    other = _leftover(run, 1, "89ab2345")
    # Never read: the listing, status and verify see markers only.
    assert sorted(commit.committed_partitions(s, 3)) == [0, 1]
    assert all(".tmp-" not in k for k in s.list(layout.COMMITS_PREFIX))
    code, out = _cli("status", run, "--json")
    assert code == 0 and json.loads(out)["counts"]["committed"] == 2
    code, out = _cli("verify", run, "--committed-only")
    assert code == 0 and "OK: every committed block matches its checksum" in out, out
    assert (f"note: 3 temporary file(s) of marker writes a stopped worker left under "
            f"{os.path.join(run, 'commits')} (never read); `actx verify {run} --repair` "
            f"removes them") in out, out

    # The next commit of partition 2 removes its leftover, and only its.
    code, said = _cli("rerun", run, "--batch-size", "4")
    assert code == 0, said
    assert not os.path.exists(redone) and os.path.exists(kept) and os.path.exists(other)
    assert commit.read_marker(s, 2) is not None

    code, out = _cli("verify", run, "--repair", "--json")
    assert code == 0, out
    assert sorted(json.loads(out)["leftover_temporaries"]) == sorted([kept, other])
    assert not os.path.exists(kept) and not os.path.exists(other)
    assert sorted(os.listdir(os.path.join(run, "commits"))) == [
        "p-00000.json", "p-00001.json", "p-00002.json"]
    code, out = _cli("verify", run)
    assert code == 0 and "temporary" not in out, out


def test_a_create_whose_temporary_the_winner_cleared_is_refused(tmp_path):
    """Two attempts commit one partition at once: the winner clears the temporaries beside
    the marker, the other's among them; the other's create then answers False (the
    marker stands), not FileNotFoundError."""
    s = store.open_store(str(tmp_path))
    key = layout.commit_key(5)
    loser_tmp = s._write_temp(key, b"{}\n")  # the loser, before its link
    assert s.create(key, b'{"winner": 1}\n')
    assert s.clear_temporaries(key) == 1 and not os.path.exists(loser_tmp)
    real_write_temp = s._write_temp
    s._write_temp = lambda k, d: (os.unlink(p := real_write_temp(k, d)), p)[1]
    assert s.create(key, b"{}\n") is False
    s._write_temp = real_write_temp
    assert s.read_json(key) == {"winner": 1}


def test_a_temporary_of_the_record_a_killed_worker_left_goes_with_the_next_worker(tmp_path):
    """A worker killed while creating activations/actx.json (a Beam SDK worker admits
    itself in every process, so a kill can land there) leaves `actx.json.tmp-...` among
    the activations: the next worker's create removes it, so a rerun leaves the run as an
    uninterrupted one (tests/test_beam_extract.py compares every object)."""
    model = hf_models.make_tiny_checkpoint(tmp_path / "model", "qwen2", num_hidden_layers=1)
    run = str(tmp_path / "run")
    token_runs.write_token_run(run, str(model), n_rows=16, seq_len=16, partition_rows=8,
                               rows_per_shard=4)  # 2 partitions
    code, said = _cli("rerun", run, "--only", "0", "--batch-size", "4")
    assert code == 0, said
    leftover = os.path.join(run, layout.ACTIVATIONS_INFO_KEY + ".tmp-0badc0de")
    with open(leftover, "w") as f:
        f.write('{"fingerprint": ')
    code, said = _cli("rerun", run, "--batch-size", "4")
    assert code == 0, said
    assert not os.path.exists(leftover)
    assert sorted(f for f in os.listdir(os.path.join(run, "activations"))
                  if f.startswith("actx.json")) == ["actx.json"]
