"""Where a run stands, in the words `actx status`, its `--json` and the launchers'
progress line give it; read from the run directory's small objects, never its activations.

  runstate.py          what the run directory says: each partition's state, the hosts,
                       the extractions (`compute_status`); what rerun selects
  partition_states.py  every partition's state, one byte a partition
  host_logs.py         the last line of a silent host's log (cached in the run)
  run_facts.py         what a run is and where it stands: identity, last verify, phase
  text.py              `actx status` in words, the one-line progress, `--json`'s content
  json_text.py         `--json`'s indented text, written fast at pod scale
  progress_line.py     where a launcher's progress line goes (a terminal, a pipe)
  job_progress.py      the progress line of a job a launcher waits for

The live page built on them is deploy/page/.
"""
