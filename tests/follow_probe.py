"""A trainer's reader in a process of its own: follows a live run (run.stream with
follow=True) and writes what it read as JSON (tests/test_reader_follow*.py).

Usage: python -m tests.follow_probe OUT.json RUN HOOK BATCH_SIZE [OPTIONS JSON]
OPTIONS: stream keywords (follow=True is added), and "stop_after": N to stop after N
batches and save the state to resume from; "resume": a state to resume from.
OUT holds: steps, epochs, tokens (row * seq_len + col, in batch order), sums (each batch's
activations summed in float64: what the trainer saw), listings, commit_order,
waiting (the last wait's words), waits (all of them), state (after the last batch), error (its text) and
first_epoch_steps. OUT.log: each line the stream logs while it waits, as it logs it.
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np

import actx
from actx.reader import errors


def main(argv: list[str]) -> int:
    out_path, run_uri, hook, batch_size = argv[0], argv[1], argv[2], int(argv[3])
    options = json.loads(argv[4]) if len(argv) > 4 else {}
    stop_after = options.pop("stop_after", None)
    # What the stream says while it waits, as it says it: OUT.log.
    handler = logging.FileHandler(out_path + ".log")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("actx.reader.follow").addHandler(handler)
    run = actx.open_run(run_uri)
    result = {"steps": [], "epochs": [], "tokens": [], "sums": [], "error": None,
              "state": None}
    stream = run.stream(hook, batch_size, follow=True, **options)
    try:
        for batch in stream:
            result["steps"].append(batch.step)
            result["epochs"].append(batch.epoch)
            result["tokens"] += (batch.rows * run.seq_len + batch.cols).tolist()
            result["sums"].append(float(np.asarray(batch.acts[hook], np.float64).sum()))
            result["state"] = stream.state(batch)
            if stop_after is not None and len(result["steps"]) >= stop_after:
                break
    except errors.RunStalledError as e:
        result["error"] = str(e)
    finally:
        stream.close()
    result.update(listings=stream.listings, commit_order=list(stream.commit_order),
                  waiting=stream.waiting, waits=stream.waits, first_epoch_steps=stream.first_epoch_steps)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
