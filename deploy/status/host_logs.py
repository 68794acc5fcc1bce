"""The last line of the hosts' logs, as status shows it for a host that stopped beating.

A preempted slice leaves every host silent, so status would read 512 logs at every refresh
(two round trips each on GCS). A silent host's log rarely changes, so what status read is
kept in the run beside the logs (`logs/<job>/last-lines.json`, layout.log_lines_key) with
each log's version (size and GCS generation or file time); a later status lists the job's
logs once, reads that one object, and reads only logs whose version moved. The object is a
cache: status works without it, and where it cannot be written (read-only credentials)
status reads the logs as before.
"""

from __future__ import annotations

import concurrent.futures
import re

from actx.schemas import errors
from actx.schemas import layout as layout_lib

# Where the last line is looked for: a fatal error's thread stacks (`last_log_line`) take
# a few KB after it.
TAIL_BYTES = 32768
# 2: a fatal error's dump is read through to the line that says why (last_log_line).
CACHE_VERSION = 2


# Python's faulthandler (on in workers, workers.main) ends the log of a process aborted in
# native code with every thread's stack, after the native frames of a failed check (absl's,
# as when JAX's coordination service ends a host). Neither says why the process ended:
# absl's fatal line does ("F1207 12:00:00.000 ... Terminating process because ..."). The
# shapes are faulthandler's own (its frames have no comma before "in", a traceback's have).
FATAL = "Fatal Python error: "
_DUMP_LINE = re.compile(r'(Fatal Python error: |Python runtime state: |Thread 0x|Current thread '
                        r'0x|Extension modules: |  File ".*", line \d+ in |  <no Python frame>)')
_NATIVE_FRAME = re.compile(r"\s*(@ +0x|\*\*\* Check failure stack trace)")
_ABSL_FATAL = re.compile(r"F\d{4} \d")  # absl: F, month and day, time


def last_log_line(text: str, max_chars: int = 300) -> str:
    """The last line a worker wrote to its log (not actx's own "[actx: ...]" notes); for a
    log that ends with a fatal error's thread stacks or a failed check's native frames,
    the error and the line that says why."""
    lines = [line.rstrip() for line in text.splitlines()]
    lines = [line for line in lines if line.strip() and not line.startswith("[actx:")]
    if not lines:
        return ""
    line = lines[-1].strip()
    if _DUMP_LINE.match(lines[-1]):
        fatal = [i for i, each in enumerate(lines) if each.startswith(FATAL)]
        if not fatal:
            line = "a fatal error's thread stacks (the error is further up the log)"
        else:
            why = _why(lines[:fatal[-1]])
            line = lines[fatal[-1]] + (f"; before it: {why}" if why else "")
    elif _NATIVE_FRAME.match(lines[-1]):
        line = _why(lines) or line
    return line if len(line) <= max_chars else line[:max_chars] + " ..."


def _why(lines: list[str]) -> str:
    """Of the lines before a fatal error's dump: absl's fatal line, else the last one that
    is no native frame."""
    said = [line.strip() for line in lines if not _NATIVE_FRAME.match(line)]
    return next((line for line in reversed(said) if _ABSL_FATAL.match(line)),
                said[-1] if said else "")


def last_lines(store, hosts: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """{(job, host): the last line of that host's log in the job} ("" for a log that is
    missing, empty or unreadable: it says nothing more, and status goes on)."""
    jobs: dict[str, list[str]] = {}
    for job, host in hosts:
        jobs.setdefault(job, []).append(host)
    out = {}
    for job, names in sorted(jobs.items()):
        out.update(((job, host), line) for host, line in _job_lines(store, job, names).items())
    return out


def _job_lines(store, job: str, hosts: list[str]) -> dict[str, str]:
    try:
        stamps = store.list_stamps(f"{layout_lib.LOGS_PREFIX}{job}/")
    except (OSError, ValueError, errors.UserError):
        return dict.fromkeys(hosts, "")
    cache_key = layout_lib.log_lines_key(job)
    cached = _read_cache(store, cache_key)
    lines, unread = {}, []
    for host in hosts:
        key = layout_lib.log_key(job, host)
        stamp = stamps.get(key)
        if stamp is None or stamp[0] == 0:
            lines[host] = ""
        elif key in cached and cached[key][:2] == list(stamp):
            lines[host] = cached[key][2]
        else:
            unread.append((host, key, stamp))
    if not unread:
        return lines
    with concurrent.futures.ThreadPoolExecutor(min(16, len(unread))) as pool:
        tails = pool.map(lambda u: _tail_line(store, u[1], u[2][0]), unread)
        for (host, key, stamp), line in zip(unread, tails):
            lines[host] = line
            if line is not None:
                cached[key] = [*stamp, line]
    _write_cache(store, cache_key, cached)
    return {host: line or "" for host, line in lines.items()}


def _tail_line(store, key: str, size: int) -> str | None:
    """The log's last line; None when it could not be read (not cached: tried again)."""
    try:
        tail = store.read_range(key, max(0, size - TAIL_BYTES), size)
    except (OSError, ValueError, errors.UserError):
        return None
    return last_log_line(tail.decode("utf-8", "replace"))


def _read_cache(store, key: str) -> dict[str, list]:
    try:
        data = store.read_json(key)
    except (OSError, ValueError, errors.UserError):
        return {}  # damaged or unreadable: read the logs
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    lines = data.get("lines")
    return {k: v for k, v in lines.items()
            if isinstance(v, list) and len(v) == 3} if isinstance(lines, dict) else {}


def _write_cache(store, key: str, lines: dict[str, list]) -> None:
    try:
        store.write_json(key, {"version": CACHE_VERSION, "lines": lines})
    except Exception:  # noqa: BLE001 — a cache that cannot be written (read-only
        pass           # credentials, a full disk) costs the next status a re-read, no more
