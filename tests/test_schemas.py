"""Schemas: config errors, fingerprints, the create-only store on every backend, layout."""

import pytest

from actx.schemas import commit, config, layout, runspec, store, uri


def _spec(**over):
    data = {"model": {"path": "m"}, "tokenizer": {"path": "t"},
            "sources": [{"kind": "arc", "paths": ["a.jsonl"]}]}
    data.update(over)
    return runspec.RunSpec.from_dict(data)


def test_unknown_key_names_key_and_file():
    with pytest.raises(config.ConfigError, match=r"run.yaml: packing.seqlen: unknown key.*seq_len"):
        runspec.RunSpec.from_dict(
            {"model": {"path": "m"}, "tokenizer": {"path": "t"},
             "sources": [{"kind": "arc", "paths": ["a"]}], "packing": {"seqlen": 3}},
            "run.yaml: ")


def test_wrong_type_names_key():
    with pytest.raises(config.ConfigError, match=r"packing.seq_len: expected an integer"):
        _spec(packing={"seq_len": "512"})
    with pytest.raises(config.ConfigError, match=r"packing.mode: expected one of"):
        _spec(packing={"mode": "packed"})


def test_layout_invariants_are_checked():
    with pytest.raises(config.ConfigError, match="multiple of rows_per_shard"):
        _spec(layout={"rows_per_shard": 8, "partition_rows": 12})


def test_chunk_tokens_must_divide_seq_len():
    with pytest.raises(config.ConfigError, match=r"chunk_tokens \(5\) must divide"):
        _spec(packing={"seq_len": 16}, layout={"chunk_tokens": 5})
    assert _spec(packing={"seq_len": 16}, layout={"chunk_tokens": 4}).layout.chunk_tokens == 4


def test_fingerprint_changes_with_any_field_and_roundtrips():
    a = _spec()
    assert runspec.RunSpec.from_dict(a.to_json_obj()).fingerprint == a.fingerprint
    assert _spec(packing={"seq_len": 513}).fingerprint != a.fingerprint
    assert _spec(capture={"dtype": "float32"}).fingerprint != a.fingerprint


def test_host_slices_are_shard_aligned_and_cover_partition():
    slices = layout.host_row_slices(64, 60, 3, 8)
    assert slices[0][0] == 64 and slices[-1][1] == 124
    for (a, b), (c, _) in zip(slices, slices[1:]):
        assert b == c and (a - 64) % 8 == 0


def test_uri_parsing():
    assert uri.parse("gs://b/x/y/").path == "x/y"
    assert str(uri.parse("gs://b/x").join("tokens", "input_ids")) == "gs://b/x/tokens/input_ids"
    assert uri.parse("memory://r").kvstore()["driver"] == "memory"
    with pytest.raises(ValueError, match="unsupported URI scheme"):
        uri.parse("s3://b/x")


@pytest.fixture(params=["file", "memory", "gs"])
def any_store(request, tmp_path):
    if request.param == "file":
        return store.open_store(tmp_path / "run")
    if request.param == "memory":
        return store.open_store(f"memory://{tmp_path.name}")
    bucket = request.getfixturevalue("gcs_bucket")
    return store.open_store(f"{bucket}/runs/r1")


def test_store_roundtrip_and_create_only(any_store):
    s = any_store
    assert s.read("a/b.json") is None
    s.write_json("a/b.json", {"x": 1})
    assert s.read_json("a/b.json") == {"x": 1}
    assert s.create("commits/p-00000.json", b"first")
    assert not s.create("commits/p-00000.json", b"second")
    assert s.read("commits/p-00000.json") == b"first"
    assert s.list("commits/") == ["commits/p-00000.json"]
    assert s.list() == ["a/b.json", "commits/p-00000.json"]
    s.delete("a/b.json")
    assert s.read("a/b.json") is None


def test_commit_is_exactly_once(any_store):
    marker = commit.CommitMarker(
        partition=3, fingerprint="f", row_start=0, row_count=8, tokens=10, block_rows=8,
        checksums={"x": [commit.checksum(b"abc")]}, dtypes={"x": "bfloat16"}, attempt="a1",
        hosts=("h0",), timings_s={"total": 1.0}, code_version="0", created_at=0.0)
    assert commit.commit(any_store, marker)
    assert not commit.commit(any_store, dataclasses_replace(marker, attempt="a2"))
    assert commit.read_marker(any_store, 3).attempt == "a1"
    assert commit.committed_partitions(any_store) == {3}


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)
