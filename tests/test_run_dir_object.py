"""The run directory as one object (schemas.run_dir.RunDir): made once from a location,
store or RunDir, its answers the same as the schemas functions it stands in front of, and
its store opened only when used. The layout test at the end holds the rule that outside
schemas/ a store is opened only for what is not the run."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from actx.schemas import commit, extraction_store, heartbeat, job_lease, layout, run_dir, store
from tests import status_runs

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def run(tmp_path):
    """A prepared run of 12 partitions, 5 committed, 3 hosts (one silent) with logs."""
    return status_runs.write_local(str(tmp_path / "run"), n_partitions=12, n_hosts=3,
                                   committed=5, dead_hosts=1, job="j1")


def test_every_form_of_a_run_names_the_same_directory(run):
    s = store.open_store(run)
    forms = [run_dir.RunDir.at(run), run_dir.RunDir.at(pathlib.Path(run)),
             run_dir.RunDir.at(s.location), run_dir.RunDir.at(s)]
    assert {f.uri for f in forms} == {run}
    assert run_dir.RunDir.at(s).store is s  # a store passed in is used, not opened again
    one = forms[0]
    assert run_dir.RunDir.at(one) is one
    opened = one.opened()
    assert isinstance(opened, run_dir.OpenedRun) and opened.store is one.store
    assert opened.opened() is opened and run_dir.open_run(opened) is opened
    assert opened.spec == status_runs.spec() and len(opened.manifest.partitions) == 12


def test_a_bucket_run_opens_no_client_until_its_store_is_used(monkeypatch):
    from actx.schemas import gcs_store

    def no_client():
        raise AssertionError("a GCS client was made")

    monkeypatch.setattr(gcs_store, "gcs_client", no_client)
    r = run_dir.RunDir.at("gs://some-bucket/runs/a")
    assert r.uri == "gs://some-bucket/runs/a"
    assert r.log_uri("job-1", "host-2") == "gs://some-bucket/runs/a/logs/job-1/host-2.log"
    assert r.extraction_name == ""
    with pytest.raises(AssertionError, match="client"):
        r.store  # noqa: B018 - the first use opens it
    with pytest.raises(ValueError, match="unsupported URI scheme"):
        run_dir.RunDir.at("s3://bucket/run")


def test_its_answers_are_the_schemas_answers(run):
    r = run_dir.RunDir.at(run)
    s = store.open_store(run)
    assert r.committed() == commit.committed_partitions(s) == set(range(5))
    assert ([(hb.host, hb.updated_at) for hb in r.heartbeats()]
            == [(hb.host, hb.updated_at) for hb in heartbeat.read_heartbeats(s)])
    assert len(r.heartbeats()) == 3
    assert r.uri_of(layout.MANIFEST_KEY) == os.path.join(run, "manifest.json")
    assert r.log_uri("j1", "host-002") == os.path.join(run, "logs", "j1", "host-002.log")
    assert r.lease() is None
    held = job_lease.acquire(s, job_lease.new("j2", ["h0"], "local", "-"))
    assert r.lease() == held == job_lease.read(s)
    r.write_log("j2", "h0", b"line\n")
    assert s.read(layout.log_key("j2", "h0")) == b"line\n"
    key = r.record_change("test", {"why": "because"})
    assert key.startswith(layout.CHANGES_PREFIX) and s.read_json(key)["why"] == "because"


def test_prepared_for_a_spec_or_only_its_tokens(run, tmp_path):
    import dataclasses

    r = run_dir.RunDir.at(run)
    spec = status_runs.spec()
    assert r.is_prepared_for(spec) and r.is_prepared_for(spec, tokens_only=True)
    other_model = dataclasses.replace(spec, model=dataclasses.replace(spec.model,
                                                                      path="another"))
    assert other_model.fingerprint != spec.fingerprint
    assert not r.is_prepared_for(other_model)
    assert r.is_prepared_for(other_model, tokens_only=True)
    other_tokens = dataclasses.replace(spec, packing=dataclasses.replace(
        spec.packing, seq_len=spec.packing.seq_len * 2))
    assert not r.is_prepared_for(other_tokens, tokens_only=True)
    # manifest.json is written last: without it the run is not prepared, whatever run.json says.
    os.remove(os.path.join(run, layout.MANIFEST_KEY))
    assert not r.is_prepared_for(spec) and not r.is_prepared_for(spec, tokens_only=True)
    assert not run_dir.RunDir.at(str(tmp_path / "nothing")).is_prepared_for(spec)


def test_an_extraction_view_keeps_its_keys_apart(run):
    r = run_dir.RunDir.at(run)
    chat = r.extraction("chat")
    assert r.extraction("") is r and r.extraction(None) is r
    assert chat.extraction_name == "chat" and chat.location == r.location
    assert chat.uri == r.uri  # messages name the run
    chat.store.create_json(layout.commit_key(7), {"partition": 7})
    assert os.path.exists(os.path.join(run, layout.extraction_key("chat", layout.commit_key(7))))
    assert chat.committed() == {7} and 7 not in r.committed()
    assert chat.extraction("base").extraction_name == "base"  # a view of the root's, not nested
    assert isinstance(chat.store, extraction_store.ExtractionStore)


def test_outside_schemas_a_store_is_opened_only_for_what_is_not_the_run():
    """issue 46: the run is one object, opened once per command; `open_store(` elsewhere
    opens a checkpoint, a tokenizer or an input's bucket, and its line (or the comment line
    before it) says which."""
    found = []
    for folder in ("deploy", "pipeline", "workers", "reader", "adapters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "open_store"):
                    said = lines[node.lineno - 1] + lines[node.lineno - 2]
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}",
                                  "not the run" in said))
    assert found, "the scan found no call at all: it no longer sees the code"
    assert [where for where, says in found if not says] == []
