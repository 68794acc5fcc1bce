"""The numbers and the line a launcher shows while workers run: a host's rate is its
steady state (start-up, its model loading and its first, compiling step, excluded), the
ETA says "estimating" until there is one, and the progress line fits the terminal (cut by
importance, rewritten in place) or, in a pipe, comes as whole lines no more often than
every few seconds. Heartbeats on a token run's store; no worker process."""

from __future__ import annotations

import io
import json
import time

import pytest

from actx.deploy import cli
from actx.deploy.status import progress_line
from actx.deploy.status import runstate
from actx.deploy.status import text as status_text
from actx.schemas import config as config_lib, heartbeat, layout, store
from actx.schemas import run_dir
from actx.workers.loop import progress
from tests import token_runs


class _Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def run(tmp_path) -> str:
    path = str(tmp_path / "run")
    token_runs.write_token_run(path, "unused-model", n_rows=24, seq_len=16, partition_rows=8,
                               rows_per_shard=4)
    return path


def _beat_of(p: progress.Progress, s, clock: _Clock, monkeypatch) -> dict:
    monkeypatch.setattr(progress.time, "monotonic", clock)
    thread = progress.HeartbeatThread(s, "h0", 0, 0, "h0-1-x", p, 1.0)
    thread.writer.min_interval_s = 0.0
    thread.beat(force=True)
    return s.read_json(layout.heartbeat_key("h0"))


def test_the_rate_counts_from_the_first_tokens_and_the_eta_estimates_until_then(
        run, monkeypatch):
    s = store.open_store(run)
    clock = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    p = progress.Progress()
    p.update(state="working", partition=0, tokens_left=50_000)
    clock.t += 60.0  # loading the model, compiling: no token
    p.add_tokens(1_000)  # the first step's tokens (the step that compiled)
    beat = _beat_of(p, s, clock, monkeypatch)
    assert beat["tokens_done"] == 1_000 and beat["tokens_per_s"] == 0.0
    assert beat["eta_s"] is None
    st = runstate.compute_status(run_dir.open_run(run))
    assert st.eta_s is None and st.eta_word == "estimating"
    assert "ETA: estimating (no steady-state rate yet" in status_text.render(st)
    assert "ETA estimating" in status_text.one_line(st)
    out = io.StringIO()
    cli.main(["status", run, "--json"], out=out)
    assert json.loads(out.getvalue())["eta"] == "estimating"

    clock.t += 10.0
    p.add_tokens(10_000)  # steady state: 10,000 tokens in 10 s
    beat = _beat_of(p, s, clock, monkeypatch)
    assert beat["tokens_per_s"] == 1_000.0  # not 11,000 / 70 s, start-up included
    assert beat["eta_s"] == pytest.approx((50_000 - 11_000) / 1_000.0)
    st = runstate.compute_status(run_dir.open_run(run))
    total = run_dir.open_run(run).manifest.total_tokens
    assert st.eta_s == pytest.approx(total / 1_000.0)  # nothing committed yet


def test_without_a_live_worker_the_eta_is_unknown(run):
    s = store.open_store(run)
    hb = heartbeat.Heartbeat(host="h0", replica=0, process_index=0, state="done",
                             attempt="a", updated_at=time.time(), tokens_done=5)
    s.write_json(layout.heartbeat_key("h0"), config_lib.to_dict(hb))
    st = runstate.compute_status(run_dir.open_run(run))
    assert st.eta_s is None and st.eta_word == "unknown"
    assert "ETA: unknown (no live worker)" in status_text.render(st)


def _live_status(run: str, hosts: int = 3) -> runstate.RunStatus:
    s = store.open_store(run)
    now = time.time()
    for h in range(hosts):
        hb = heartbeat.Heartbeat(
            host=f"a-rather-long-host-name-{h:03d}", replica=h, process_index=0,
            state="working", attempt=f"x{h}", updated_at=now, partition=h, tokens_done=40,
            tokens_per_s=123.0, history=((now - 30, 0), (now, 40)))
        s.write_json(layout.heartbeat_key(hb.host), config_lib.to_dict(hb))
    s.create_json(layout.commit_key(0), {"partition": 0})
    return runstate.compute_status(run_dir.open_run(run))


@pytest.mark.parametrize("width", [40, 60, 79, 119, 200])
def test_the_line_fits_the_width_keeping_what_matters_most(run, width):
    st = _live_status(run)
    full = status_text.one_line(st)
    line = status_text.one_line(st, width)
    assert len(line) <= width, (width, line)
    assert line.startswith(f"[{st.name}] 1/3 committed")
    if width >= 79:  # an 80-column terminal: committed, tokens, ETA and the rate
        assert "% tokens" in line and f"ETA {status_text._duration(st.eta_s)}" in line
        assert "tok/s now" in line
    if len(full) <= width:
        assert line == full
    # Every part kept after the counts is one of the full line's, in its order.
    kept, parts = line.split(" | ")[1:], iter(full.split(" | ")[1:])
    assert all(part in parts for part in kept), (line, full)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_line_is_rewritten_in_place_within_its_columns(run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    st = _live_status(run)
    term = _Terminal()
    shown = progress_line.ProgressLine(term)
    for _ in range(3):
        shown.show(lambda width: status_text.lines_per_extraction({"": st}, width))
    shown.end()
    text = term.getvalue()
    frames = text.split("\r\x1b[2K")[1:]
    assert len(frames) == 3 and text.count("\n") == 1 and text.endswith("\n")
    assert all(len(f.rstrip("\n")) <= 79 for f in frames), [len(f) for f in frames]


def test_in_a_pipe_whole_lines_no_more_than_one_every_few_seconds(run):
    pipe = io.StringIO()
    clock = _Clock()
    shown = progress_line.ProgressLine(pipe, pipe_every_s=10.0, clock=clock)
    said = []
    for second in range(0, 35):  # a new line every second, polled every second
        clock.t = 1000.0 + second
        shown.show(lambda width, n=second: f"line {n}")
    shown.show(lambda width: "the last one", force=True)
    said = pipe.getvalue().splitlines()
    assert said == ["line 0", "line 10", "line 20", "line 30", "the last one"]
    assert "\r" not in pipe.getvalue()
    # Nothing new, nothing printed, however long it waits.
    clock.t += 100
    shown.show(lambda width: "the last one")
    assert pipe.getvalue().splitlines() == said


def test_durations_round_halves_up_as_the_page_does():
    """Elapsed times are recorded to 0.1 s; the text rounds a half up, as the page's
    JavaScript Math.round does, so both say the same (Python's round(2.5) is 2)."""
    js_math_round = {0.4: 0, 0.5: 1, 1.5: 2, 2.5: 3, 59.5: 60, 3599.5: 3600}  # per ECMA-262
    expected = {0: "0s", 1: "1s", 2: "2s", 3: "3s", 60: "1m00s", 3600: "1h00m00s"}
    for seconds, rounded in js_math_round.items():
        assert status_text._duration(seconds) == expected[rounded], seconds


def test_a_silence_of_the_heartbeats_is_told_once_while_it_lasts_and_once_for_its_gap(
        monkeypatch):
    """What a worker checks its partitions in hand after (`Progress.was_silent`): beats
    written closer than `silent_after_s` say nothing; a silence under way is told once,
    and the gap it leaves once more when the next beat is written (the first beat after a
    freeze may come after a writer thread asked), then nothing while beats keep coming."""
    clock = _Clock()
    monkeypatch.setattr(progress, "awake_time", clock)
    p = progress.Progress()
    assert not p.was_silent()  # no beat yet
    p.silent_after_s = 4.0
    p.wrote_beat(clock())
    clock.t += 3.0
    p.wrote_beat(clock())
    assert not p.was_silent()
    clock.t += 10.0
    assert p.was_silent() and not p.was_silent()
    p.wrote_beat(clock())
    assert p.was_silent() and not p.was_silent()
    clock.t += 3.0
    p.wrote_beat(clock())
    assert not p.was_silent()


def test_after_a_silence_each_beat_is_told_for_as_long_as_a_taker_may_act_on_it(
        monkeypatch):
    """A taker may claim from a heartbeat listing read during the silence, after the
    worker's first looks: for `watch_after_silence_s` after it, each beat written is
    told once (one look a beat); then beats say nothing again."""
    clock = _Clock()
    monkeypatch.setattr(progress, "awake_time", clock)
    p = progress.Progress()
    p.silent_after_s, p.watch_after_silence_s = 4.0, 20.0
    p.wrote_beat(clock())
    clock.t += 10.0
    p.wrote_beat(clock())  # the gap: watched until t + 20
    assert p.was_silent() and not p.was_silent()
    for _ in range(6):  # beats 3 s apart, the last at +18
        clock.t += 3.0
        p.wrote_beat(clock())
        assert p.was_silent() and not p.was_silent()
    clock.t += 3.0  # +21: past the watch
    p.wrote_beat(clock())
    assert not p.was_silent()


def test_the_silence_clock_goes_on_while_the_machine_sleeps():
    if not hasattr(time, "CLOCK_BOOTTIME"):
        pytest.skip("no CLOCK_BOOTTIME here")
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert before <= progress.awake_time() <= time.clock_gettime(time.CLOCK_BOOTTIME)
