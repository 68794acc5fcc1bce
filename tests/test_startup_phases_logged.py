"""The phases before the first step (loading the model and its weights, compiling the
step) appear in submit's output as lines of their own, tty or not (issue 66, item 8): a
log keeps the longest wait of a small run, which the progress line (rewritten in place,
or in a pipe at most every few seconds) leaves out. A real local worker process."""

from __future__ import annotations

import io

from actx.deploy import config as deploy_config
from actx.deploy import demo, local
from actx.deploy.status import progress_line
from tests import token_runs


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_startup_phases_are_lines_of_their_own(tmp_path):
    model = demo.make_tiny_qwen2(str(tmp_path / "model"), num_layers=1, vocab_size=512)
    for out in (io.StringIO(), _Tty()):
        run = str(tmp_path / f"run-{type(out).__name__}")
        spec = token_runs.write_token_run(run, model, n_rows=32, seq_len=16,
                                          partition_rows=8, rows_per_shard=4)
        target = deploy_config.TargetConfig(hosts=1, batch_size=8, heartbeat_s=0.2)
        assert local.run_workers(run, target, spec.fingerprint, "job", progress_s=0.1,
                                 out=out) == 0, out.getvalue()
        text = out.getvalue().replace("\r\x1b[2K", "\n")
        lines = [x for x in text.splitlines() if x.startswith("extract: local-r0h0 ")]
        phases = [x.removeprefix("extract: local-r0h0 ") for x in lines]
        # Each phase once, in the worker's order, all before the first line that has a rate
        # (the worker's first tokens). The launcher reads them from heartbeats every
        # progress_s, so a tiny model's phase shorter than that may not be seen at all.
        assert phases and len(set(phases)) == len(phases), phases
        order = ("loading the model", "loading weights", "checking the run against the model",
                 "compiling the step", "warming up")
        ranks = [next(i for i, p in enumerate(order) if x.startswith(p)) for x in phases]
        assert ranks == sorted(ranks), phases
        all_lines = text.splitlines()
        first_rate = next(i for i, x in enumerate(all_lines) if " tok/s" in x)
        assert all(all_lines.index(x) < first_rate for x in lines), text
    assert progress_line.ProgressLine(_Tty()).tty
