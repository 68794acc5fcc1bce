"""Beam PipelineOptions for prepare: the runner, named explicitly, and remote staging.

Locally the default is Beam's in-process FnApiRunner, created explicitly (a plain
"DirectRunner" may try to fetch the Prism runner, and there is no network). Any other
`--runner` (DataflowRunner, FlinkRunner, SparkRunner, ...) is passed through unchanged,
with this repository's setup.py staged to remote workers unless --setup_file is given.
"""

from __future__ import annotations

import os

from actx.pipeline import quiet_beam  # noqa: F401 (first: Beam's import, quietly)
import apache_beam as beam
from apache_beam.options.pipeline_options import (DirectOptions, PipelineOptions, SetupOptions,
                                                  StandardOptions)

LOCAL_RUNNERS = ("", "DirectRunner", "FnApiRunner", "direct")
_REMOTE_RUNNERS = ("DataflowRunner", "FlinkRunner", "SparkRunner", "PortableRunner")
SETUP_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")


# Beam's state sampler (a thread per bundle that attributes time to steps) sleeps up to
# 200 ms between samples, and a bundle's end waits for it to wake: prepare's long bundles
# (tokenize, write) each lost ~0.1 s on average to that wait, in-process. 20 ms keeps the
# sampling and costs nothing measurable.
LOCAL_STATE_SAMPLING_MS = 20


def _shorten_state_sampling() -> None:
    """Lowers the in-process sampler's period, where Beam still has the 200 ms default
    (a Beam internal: anything unexpected leaves it alone)."""
    try:
        from apache_beam.runners.worker import statesampler

        init = statesampler.StateSampler.__init__
        if init.__defaults__ == (statesampler.DEFAULT_SAMPLING_PERIOD_MS,):
            init.__defaults__ = (min(LOCAL_STATE_SAMPLING_MS,
                                     statesampler.DEFAULT_SAMPLING_PERIOD_MS),)
    except (ImportError, AttributeError, TypeError):
        pass


def make_pipeline(pipeline_args: list[str] | None = None) -> beam.Pipeline:
    """A Pipeline for `pipeline_args` (Beam flags: --runner, --direct_num_workers, ...)."""
    options = PipelineOptions(list(pipeline_args or []))
    standard = options.view_as(StandardOptions)
    name = standard.runner or ""
    if name in LOCAL_RUNNERS:
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        standard.runner = None
        _shorten_state_sampling()
        return beam.Pipeline(runner=FnApiRunner(), options=options)
    if name in _REMOTE_RUNNERS and os.path.isfile(SETUP_PY):
        setup = options.view_as(SetupOptions)
        if not setup.setup_file:
            setup.setup_file = SETUP_PY
    return beam.Pipeline(runner=name, options=options)


def describe(pipeline_args: list[str] | None = None) -> str:
    """One line naming the runner and its parallelism, for the log."""
    options = PipelineOptions(list(pipeline_args or []))
    name = options.view_as(StandardOptions).runner or ""
    if name in LOCAL_RUNNERS:
        direct = options.view_as(DirectOptions)
        return (f"FnApiRunner (in-process, {direct.direct_running_mode}, "
                f"{direct.direct_num_workers or 1} worker(s))")
    return name
