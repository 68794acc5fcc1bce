"""bench/read.py --float8 --cold, shrunk: both dtypes' streams, each epoch read from the disk
after the run's files left the page cache, side by side in one run."""

import re
import subprocess
import sys

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_float8_streams_from_the_disk_side_by_side():
    done = subprocess.run(
        [sys.executable, "bench/read.py", "--float8", "--cold", "--codec", "zstd",
         "--rows", "64", "--seq-len", "64", "--hidden", "32", "--rounds", "1",
         "--passes", "1", "--batch-size", "256", "--buffer-tokens", "1024"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "each epoch from the disk (page cache dropped before it)" in out, out
    rates = {name: float(rate.replace(",", "")) for name, rate in re.findall(
        r"^  (bfloat16|float8_e4m3(?: as bfloat16)?)\s+([\d,]+) tokens/s", out, re.M)}
    assert set(rates) == {"bfloat16", "float8_e4m3", "float8_e4m3 as bfloat16"}, out
    assert all(r > 0 for r in rates.values()), out
    assert "handed over as float32" in out and "handed over as bfloat16" in out, out
