"""A generating run end to end: a real Beam prepare of prompts with the real Qwen
vocabulary reserves room after each prompt, a real worker process writes into it, and
every stored token, prompt and generated alike, is checked against HF transformers:
`generate`'s greedy ids and text, then its forward over prompt + generated. Prompts longer
than a row and answers that cross rows and partitions included; then the reader's roles,
`actx verify`, sampling's determinism across replicas and reruns, and the refusals."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from actx.pipeline import main as prepare_main
from actx.schemas import layout, runspec, store
from actx.schemas.config import ConfigError
from tests import generate_runs, hf_models, token_runs, worker_procs

HOOK_NAMES = generate_runs.HOOKS.split(",")
MAX_NEW = 24
STOP, PROMPTS = generate_runs.STOP, generate_runs.PROMPTS


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return generate_runs.tiny_qwen2(tmp_path_factory.mktemp("m") / "qwen2")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    return generate_runs.write_prompts(tmp_path_factory.mktemp("in") / "prompts.jsonl")


def _spec(model: str, tokenizer: str, prompts: str, **generate) -> runspec.RunSpec:
    # 32-token rows: the 49-token prompt crosses a row, answers cross rows, and partitions
    # of 4 rows cut documents.
    return runspec.RunSpec.from_dict(generate_runs.spec_dict(
        model, tokenizer, prompts, max_new_tokens=MAX_NEW, **generate))


_generated_run = generate_runs.generated_run


def _document_places(run: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each document's (rows, cols), in document order."""
    doc_index = token_runs.read_tokens(run, "doc_index")
    positions = token_runs.read_tokens(run, "positions")
    places = {}
    for d in sorted(set(np.unique(doc_index).tolist()) - {-1}):
        where = np.nonzero(doc_index == d)
        order = np.argsort(positions[where])
        places[d] = (where[0][order], where[1][order])
    return places


@pytest.fixture(scope="module")
def greedy(model, qwen_tokenizer_dir, prompts_file, tmp_path_factory) -> str:
    run = str(tmp_path_factory.mktemp("greedy") / "run")
    _generated_run(run, _spec(model, qwen_tokenizer_dir, prompts_file,
                              stop_token_ids=[STOP]))
    return run


def test_greedy_run_is_hf_generate_and_every_token_hf_forward(greedy, model,
                                                              qwen_tokenizer_dir):
    # The prompt as HF's tokenizer gives it, the answer HF generate's, every hook of every
    # token HF's forward over prompt + answer, the ids beside them (generate_runs).
    checked = generate_runs.assert_every_token_is_hf(greedy, model, qwen_tokenizer_dir,
                                                     PROMPTS, MAX_NEW, STOP)
    assert sorted(checked) == sorted(_document_places(greedy)) == list(range(len(PROMPTS)))
    reasons, crossing = set(), {"prompt": False, "answer": False}
    for d, (r, c, e) in checked.items():
        prompt_len, answer = e["prompt_tokens"], e["generated_ids"]
        assert len(r) == prompt_len + MAX_NEW  # its room, reserved by prepare
        assert e["stop_reason"] == ("stop_token" if answer[-1] == STOP else "length")
        assert e["stop_token_ids"] == [STOP]
        reasons.add(e["stop_reason"])
        n = prompt_len + len(answer)
        crossing["prompt"] |= len(set(r[:prompt_len].tolist())) > 1
        crossing["answer"] |= len(set(r[prompt_len:n].tolist())) > 1
    assert reasons == {"stop_token", "length"}
    assert crossing == {"prompt": True, "answer": True}


def test_a_repetition_penalty_run_is_hf_generate_with_that_penalty(
        greedy, model, qwen_tokenizer_dir, prompts_file, tmp_path):
    """generate.repetition_penalty through prepare and a worker process: run.json records
    it, every answer is HF generate's with that penalty (and some differ from the
    unpenalised run's), every token's hooks HF's forward. While 1 it is absent from
    run.json, so a spec written before the key keeps its fingerprint."""
    spec = _spec(model, qwen_tokenizer_dir, prompts_file, stop_token_ids=[STOP],
                 repetition_penalty=2.0)
    run = str(tmp_path / "run")
    _generated_run(run, spec)
    recorded = store.open_store(run).read_json(runspec.RUN_SPEC_KEY)
    assert recorded["generate"]["repetition_penalty"] == 2.0
    checked = generate_runs.assert_every_token_is_hf(run, model, qwen_tokenizer_dir, PROMPTS,
                                                     MAX_NEW, STOP, repetition_penalty=2.0)
    unpenalised = generate_runs.records(greedy)
    assert any(e["generated_ids"] != unpenalised[d]["generated_ids"]
               for d, (_, _, e) in checked.items())
    plain = _spec(model, qwen_tokenizer_dir, prompts_file, stop_token_ids=[STOP])
    assert "repetition_penalty" not in plain.to_dict()["generate"]
    written_before = plain.to_dict()  # as an actx without the key wrote it
    assert runspec.RunSpec.from_dict(written_before).fingerprint == plain.fingerprint
    assert spec.fingerprint != plain.fingerprint


def test_the_reader_reads_prompt_and_answer_apart(greedy):
    from actx import reader

    run = reader.open_run(greedy)
    assert sorted(run.hooks) == sorted(HOOK_NAMES)  # the ids are stored beside the hooks
    generated = token_runs.read_activation(greedy, layout.GENERATED_IDS)[..., 0]
    segment_ids = token_runs.read_tokens(greedy, "segment_ids")
    stored = token_runs.read_activation(greedy, "final_norm")

    def places(selection):
        return set(zip(selection.rows.tolist(), selection.cols.tolist()))

    answers = run.select("final_norm", generated=True)
    assert places(answers) == set(zip(*np.nonzero(generated >= 0)))
    np.testing.assert_array_equal(answers.acts["final_norm"],
                                  stored[answers.rows, answers.cols])
    # what each token is: the id the model wrote (tokens/input_ids holds the pad id there)
    assert answers.input_ids.tolist() == generated[answers.rows, answers.cols].tolist()
    prompts = run.select("final_norm", exclude=["generated"])
    assert places(prompts) == set(zip(*np.nonzero((generated == layout.GENERATED_PROMPT)
                                                  & (segment_ids > 0))))
    seen = []
    with run.batches("final_norm", batch_size=16, seed=0, drop_last=False,
                     prefetch=1) as batches:
        for b in batches:
            seen += list(zip(b.rows.tolist(), b.cols.tolist()))
    # every token of a prompt or an answer once; the unused room never
    assert sorted(seen) == sorted(places(answers) | places(prompts))
    with run.batches("final_norm", batch_size=16, seed=0, drop_last=False, prefetch=1,
                     exclude=["prompt"]) as batches:
        assert sum(len(b.rows) for b in batches) == len(answers.rows)


def test_verify_reads_a_generating_run_back(greedy, capsys):
    from actx.deploy import cli

    assert cli.main(["verify", greedy]) == 0
    assert "every committed block matches its checksum" in capsys.readouterr().out


def test_sampling_is_the_same_on_any_host_and_in_a_rerun(
        model, qwen_tokenizer_dir, prompts_file, tmp_path):
    spec = _spec(model, qwen_tokenizer_dir, prompts_file, temperature=1.0, top_k=50,
                 samples_per_prompt=2, seed=7, stop_token_ids=[STOP])
    run = str(tmp_path / "run")
    _generated_run(run, spec, batch_size=4)
    records = generate_runs.records(run)
    assert len(records) == 2 * len(PROMPTS)
    by_prompt = {}
    for e in records.values():
        by_prompt.setdefault(e["prompt_doc"], []).append(e["generated_ids"])
    assert any(a != b for a, b in by_prompt.values())  # two samples, two streams

    before = worker_procs.stored_objects(run)
    two = str(tmp_path / "two")  # two one-host replicas, each its share of the partitions
    worker_procs.copy_token_store(run, two)
    procs = [worker_procs.start_worker(["--run", two, "--batch-size", "4", "--replicas", "2",
                                        "--replica", str(i)], devices=1) for i in range(2)]
    for proc in procs:
        code, out = worker_procs.finish(proc)
        assert code == 0, out
    assert worker_procs.stored_objects(two) == before
    assert generate_runs.records(two) == records

    s = store.open_store(run)
    s.delete(layout.commit_key(0))
    s.delete(layout.generated_key(0))
    code, out = worker_procs.run_worker(["--run", run, "--batch-size", "4"], devices=1)
    assert code == 0, out
    assert worker_procs.stored_objects(run) == before
    assert generate_runs.records(run) == records


def test_a_prompt_without_room_is_rejected_with_its_reason(model, qwen_tokenizer_dir,
                                                           prompts_file, tmp_path):
    spec = runspec.RunSpec.from_dict({
        **_spec(model, qwen_tokenizer_dir, prompts_file).to_dict(),
        "packing": {"mode": "pad", "seq_len": 32, "max_context": 64}})
    run = str(tmp_path / "run")
    m = prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"], max_reject_fraction=0.5)
    assert m.docs_rejected == 1  # the 49-token prompt: 49 + 24 > 64
    rejects = [json.loads(line) for key in store.open_store(run).list("rejects/")
               for line in store.open_store(run).read(key).decode().splitlines()]
    assert len(rejects) == 1 and rejects[0]["line"] == 2  # 1-based: the second prompt
    assert "generate.max_new_tokens=24" in rejects[0]["reason"]


@pytest.mark.parametrize("change, key", [
    ({"packing": {"mode": "concat"}}, "packing.mode"),
    ({"packing": {"overflow": "truncate"}}, "packing.overflow"),
    ({"generate": {"temperature": -0.5}}, "temperature"),
    ({"generate": {"max_new_tokens": 4096}}, "generate.max_new_tokens"),
    ({"generate": {"top_p": 0}}, "top_p"),
    ({"tokenizer": {"path": "t", "add_eos": True}}, "tokenizer.add_eos"),
    ({"sources": [{"kind": "arc", "paths": ["a"], "arc_include_test_output": True}]},
     "arc_include_test_output"),
])
def test_what_cannot_generate_is_refused_naming_the_key(change, key):
    data = {"model": {"path": "m"}, "tokenizer": {"path": "t"},
            "sources": [{"kind": "text", "paths": ["x"]}], "generate": {"max_new_tokens": 8}}
    for name, value in change.items():
        data[name] = {**data.get(name, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        runspec.RunSpec.from_dict(data)


def test_stop_ids_outside_the_vocabulary_are_refused_before_work(model, qwen_tokenizer_dir,
                                                                 prompts_file, tmp_path):
    from actx.workers import preflight

    spec = _spec(model, qwen_tokenizer_dir, prompts_file, stop_token_ids=[STOP, 200000])
    problems = preflight.check_job(spec, batch_size=4).problems
    assert any("generate.stop_token_ids: [200000] outside the model's vocabulary" in p
               for p in problems), problems


def test_several_models_each_write_their_own_text_over_one_token_store(
        model, qwen_tokenizer_dir, prompts_file, tmp_path):
    from actx import reader
    from actx.deploy import cli

    other = hf_models.make_tiny_checkpoint(tmp_path / "other", "qwen2", seed=1,
                                           vocab_size=151936, num_hidden_layers=2)
    models = {"base": model, "other": other}
    run = tmp_path / "run"
    config = {"run": str(run),
              "spec": generate_runs.spec_dict(model, qwen_tokenizer_dir, prompts_file,
                                              max_new_tokens=8),
              "extractions": {name: {"model": {"path": path, "dtype": "float32"}}
                              for name, path in models.items()},
              "target": {"kind": "local", "hosts": 1, "batch_size": 4}}
    (tmp_path / "two.yaml").write_text(json.dumps(config))
    assert cli.main(["submit", str(tmp_path / "two.yaml")], out=io.StringIO()) == 0
    texts = {}
    for name, path in models.items():
        opened = reader.open_run(str(run), extraction=name)
        samples = opened.generations()
        texts[name] = [s["generated_ids"] for s in samples]
        hf = hf_models.load_hf_model(path)
        first = opened.document(0, ["final_norm"])  # prompt, answer and unused room
        generated = token_runs.read_activation(
            str(run / "extractions" / name), layout.GENERATED_IDS)[first.rows, first.cols, 0]
        text = np.asarray(first.input_ids)[generated != layout.GENERATED_UNUSED]  # what it read
        assert text[samples[0]["prompt_tokens"]:].tolist() == samples[0]["generated_ids"]
        reference = hf_models.hf_hooks(hf, text[None])["final_norm"][0]
        worker_procs.assert_close(first.acts["final_norm"][:len(text)], reference, 1e-5,
                                  f"extraction {name}, document 0")
    assert texts["base"] != texts["other"]  # each model wrote its own


def test_a_generating_worker_frozen_in_a_partition_writes_nothing_over_its_taker(
        greedy, model, qwen_tokenizer_dir, prompts_file, tmp_path):
    """A generating worker frozen (SIGSTOP, at its third generation step) long enough to
    look dead while a worker of another job generates the whole run: resumed, it finds
    the partition in hand taken over and writes none of its rows and not its record
    (`generated/p-N.json`), commits nothing more, and exits 0. The run is the one worker's
    run byte for byte, and verifies."""
    import os
    import signal
    import time

    from actx.deploy import cli
    from actx.schemas import commit

    spec = _spec(model, qwen_tokenizer_dir, prompts_file, stop_token_ids=[STOP])
    run = str(tmp_path / "run")
    prepare_main.run_prepare(spec, run, ["--runner=FnApiRunner"])
    s = store.open_store(run)
    log, asked = tmp_path / "writes.log", tmp_path / "writes.log.asked"

    def lines(path) -> list[str]:
        return path.read_text().splitlines() if path.exists() else []

    def stopped(pid: int) -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    frozen = worker_procs.start_worker(
        ["--run", run, "--batch-size", "4", "--job", "first", "--heartbeat-s", "1"], devices=1,
        ACTX_CRASH_AT="step:3:STOP", ACTX_WRITE_LOG=str(log))
    try:
        deadline = time.monotonic() + 240
        while not stopped(frozen.pid):
            assert frozen.poll() is None, worker_procs.finish(frozen)
            assert time.monotonic() < deadline
            time.sleep(0.2)
        written_before, asked_before = len(lines(log)), set(lines(asked))
        committed_at_freeze = commit.committed_partitions(s)
        time.sleep(4)  # over 2.5 heartbeat intervals: the frozen worker looks dead
        code, out = worker_procs.run_worker(
            ["--run", run, "--batch-size", "4", "--job", "taker", "--host-name", "taker"],
            devices=1)
        assert code == 0, out
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    code, out = worker_procs.finish(frozen, timeout=180)
    assert code == 0, out
    assert "were taken over meanwhile by another attempt" in out, out
    after = [line for line in lines(log)[written_before:]
             if line.startswith(f"{frozen.pid} ") and line not in asked_before]
    assert after == [], after
    for pid in commit.committed_partitions(s) - committed_at_freeze:
        assert commit.read_marker(s, pid).attempt.startswith("taker-")
    assert worker_procs.stored_objects(run) == worker_procs.stored_objects(greedy)
    assert generate_runs.records(run) == generate_runs.records(greedy)
    assert cli.main(["verify", run], out=io.StringIO()) == 0
