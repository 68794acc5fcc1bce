"""Finds the real Slurm cluster that tests/slurm_cluster.sh started on this machine (.ci/run
starts it before the tests and stops it after), for the tests marked `real_slurm`.

`cluster()` gives its slurm.conf, or skips the test saying why there is none: the reason
the script recorded (not root, no apt, a daemon that did not start), or that it was not
started at all (with the command that starts it).
"""

from __future__ import annotations

import os
import subprocess

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slurm_cluster.sh")
NODES = ("actx-n1", "actx-n2")


def state_dir() -> str:
    return os.environ.get("ACTX_SLURM_DIR", "/tmp/actx-slurm")


def why_not() -> str | None:
    """None when the cluster is up (both nodes answer sinfo), else why the tests skip."""
    directory = state_dir()
    ready = os.path.join(directory, "ready")
    if not os.path.exists(ready):
        try:
            with open(os.path.join(directory, "why")) as f:
                return f"no real Slurm cluster: {f.read().strip()}"
        except OSError:
            return (f"no real Slurm cluster is running (no {ready}): start one with "
                    f"`sudo {SCRIPT} install && sudo {SCRIPT} start` (.ci/run does)")
    conf = os.path.join(directory, "slurm.conf")
    try:
        done = subprocess.run(["sinfo", "--noheader", "-N", "-o", "%N %t"], capture_output=True,
                              text=True, timeout=30, env={**os.environ, "SLURM_CONF": conf})
    except (OSError, subprocess.SubprocessError) as e:
        return f"the real Slurm cluster does not answer sinfo: {e}"
    if done.returncode != 0:
        return f"the real Slurm cluster does not answer sinfo: {done.stderr.strip()}"
    return None


def cluster() -> str:
    """The running cluster's slurm.conf (SLURM_CONF); skips the calling test without one."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    return os.path.join(state_dir(), "slurm.conf")
