"""Following actx's advice as printed (issue 66, item 7): the command of a kind
(schemas.advice.KINDS) that a text advises, found with `advice.find` and run exactly as
written through actx's entry point (the reader's `python -c ...` through python), and the
table of where each kind is followed, per target: `FOLLOWED_IN`, which
tests/test_advice_followed.py holds against the registry (every kind has a situation; each
named test follows that kind through `follow`)."""

from __future__ import annotations

import io
import shlex
import subprocess
import sys

from actx.deploy import cli
from actx.schemas import advice

# Each kind of advice: {target: the test that prints it in its situation and follows it}.
FOLLOWED_IN = {
    "rerun": {
        "local": "tests/test_advice_followed.py::"
                 "test_a_dead_worker_with_claims_ahead_is_finished_by_what_every_view_advises",
        "slurm": "tests/test_slurm_real.py::"
                 "test_killed_task_then_the_advice_as_printed_completes_without_duplicates",
        "tpu-vm": "tests/test_pod_journey.py::test_pod_journey_submit_preempt_rerun_verify_down",
    },
    "rerun_on": {
        "slurm": "tests/test_slurm_real.py::"
                 "test_detached_advice_as_printed_stops_resumes_and_finishes_the_run",
    },
    "rerun_recreate": {
        "tpu-vm": "tests/test_pod_journey.py::test_pod_journey_submit_preempt_rerun_verify_down",
    },
    "verify": {
        "local": "tests/test_advice_followed.py::"
                 "test_a_dead_worker_with_claims_ahead_is_finished_by_what_every_view_advises",
        "slurm": "tests/test_slurm_real.py::"
                 "test_detached_advice_as_printed_stops_resumes_and_finishes_the_run",
    },
    "repair": {
        "local": "tests/test_advice_followed.py::"
                 "test_a_failed_verify_is_finished_by_the_commands_it_prints",
    },
    "status": {
        "local": "tests/test_advice_followed.py::"
                 "test_the_readers_advice_on_a_run_not_extracted_yet_finishes_it",
    },
    "watch": {
        "slurm": "tests/test_slurm_real.py::"
                 "test_detached_advice_as_printed_stops_resumes_and_finishes_the_run",
    },
    "status_json": {
        "local": "tests/test_advice_followed.py::"
                 "test_a_dead_worker_with_claims_ahead_is_finished_by_what_every_view_advises",
    },
    "down": {
        "slurm": "tests/test_slurm_real.py::"
                 "test_detached_advice_as_printed_stops_resumes_and_finishes_the_run",
        "tpu-vm": "tests/test_pod_journey.py::test_pod_journey_submit_preempt_rerun_verify_down",
    },
    "read": {
        "local": "tests/test_advice_followed.py::"
                 "test_a_dead_worker_with_claims_ahead_is_finished_by_what_every_view_advises",
    },
    "reprepare": {
        "local": "tests/test_advice_followed.py::"
                 "test_a_damaged_token_store_is_named_and_its_advice_finishes_the_run",
    },
}


def advised(text: str, kind: str) -> str:
    """The one command of `kind` that `text` advises (every mention of it the same)."""
    commands = {command for found, command in advice.find(text) if found == kind}
    assert len(commands) == 1, f"advice of kind {kind}: {sorted(commands)} in:\n{text}"
    return commands.pop()


def follow(text: str, kind: str, *extra: str) -> tuple[int, str]:
    """Runs the command of `kind` that `text` advises exactly as printed, with `extra`
    arguments a test needs to follow it here (--job NAME, --wait); (exit code, output)."""
    argv = shlex.split(advised(text, kind)) + list(extra)
    if argv[0] == "python":  # the reader's, in a fresh interpreter as typed
        done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                              timeout=300)
        return done.returncode, done.stdout + done.stderr
    assert argv[0] == "actx", argv
    out = io.StringIO()
    return cli.main(argv[1:], out=out), out.getvalue()
