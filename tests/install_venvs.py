"""Fresh virtual environments holding actx with one extra, for the install tests
(tests/test_install_extras*.py): one wheel directory, built once per test run and shared
by the xdist workers, and a venv per extra installed from it with no index."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

SKIP_UNLESS_ASKED = pytest.mark.skipif(
    os.environ.get("ACTX_INSTALL_TESTS") != "1",
    reason="builds a virtual environment per extra (minutes); ACTX_INSTALL_TESTS=1 runs them")

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("setup.py", "actx", "schemas", "pipeline", "workers", "deploy", "reader", "adapters")
REFERENCE_ONLY = {"torch", "transformers"}  # the tests' reference: no lean extra brings them
# pip compiles every installed module to bytecode, about half of an install's CPU (a venv of
# actx-lm[demo] from the wheel directory: 29 -> 15 core-seconds without). It changes
# nothing these tests check (which packages resolve and install, and that the smoke commands
# run); the modules a command imports are compiled as it imports them.
NO_BYTECODE = ("--no-compile",)


def run_ok(cmd, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def report(line: str) -> None:
    print(f"[install] {line}", file=sys.stderr)


class Venv:
    """A fresh virtual environment holding actx with one extra, from the wheel directory."""

    def __init__(self, root: pathlib.Path, wheels: pathlib.Path, extra: str | None):
        self.root, self.extra = root, extra
        start = time.monotonic()
        run_ok([sys.executable, "-m", "venv", root])
        requirement = "actx-lm" if extra is None else f"actx-lm[{extra}]"
        run_ok([self.python, "-m", "pip", "install", "-q", *NO_BYTECODE, "--no-index",
                "--find-links", wheels, requirement])
        seconds = time.monotonic() - start
        size_mb = int(run_ok(["du", "-sm", root]).stdout.split()[0])
        report(f"{requirement}: venv + install {seconds:.0f} s, {size_mb} MB")
        listed = json.loads(run_ok([self.python, "-m", "pip", "list", "--format=json"]).stdout)
        self.packages = {p["name"].lower().replace("_", "-") for p in listed}

    def install_from_pypi(self, *requirements: str) -> None:
        """Other projects' packages from the package index, beside actx."""
        start = time.monotonic()
        run_ok([self.python, "-m", "pip", "install", "-q", *NO_BYTECODE, *requirements])
        report(f"{self.extra}: + {' '.join(requirements)} from the index "
               f"{time.monotonic() - start:.0f} s")

    @property
    def python(self) -> pathlib.Path:
        return self.root / "bin" / "python"

    def env(self, **extra: str) -> dict:
        """The caller's environment (GCS emulator endpoints included), as a fresh shell in
        this venv sees it: its bin first, no PYTHONPATH, no test-only XLA flags."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "XLA_FLAGS", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["JAX_PLATFORMS"] = "cpu"
        env.update(extra)
        return env

    def run(self, args, cwd: pathlib.Path, timeout: float = 600, **env: str):
        """`args` in this venv, from `cwd` (outside the checkout, so only installed code runs)."""
        start = time.monotonic()
        proc = run_ok(args, timeout=timeout, cwd=cwd, env=self.env(**env))
        report(f"{self.extra or 'default'}: {' '.join(map(str, args))[:60]}... "
               f"{time.monotonic() - start:.0f} s")
        return proc


def assert_lacks(venv: Venv, *names: str) -> None:
    present = sorted(venv.packages & (REFERENCE_ONLY | set(names)))
    assert not present, f"actx-lm[{venv.extra}] installed {present}"


def wheelhouse(tmp_path_factory) -> pathlib.Path:
    """actx's wheel and every wheel its lean extras need, built once from this checkout per
    test run: the first xdist worker to ask builds it under a lock, the others reuse it."""
    base = tmp_path_factory.getbasetemp()
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = (base.parent / f"wheelhouse-{run_id}") if run_id else base / "wheelhouse"
    root.mkdir(parents=True, exist_ok=True)
    wheels, done = root / "wheels", root / "done"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(root / "src", ignore_errors=True)
            shutil.rmtree(wheels, ignore_errors=True)
            _build_wheels(root / "src", wheels)
            done.write_text("ok")
    return wheels


def _build_wheels(src: pathlib.Path, wheels: pathlib.Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    start = time.monotonic()
    run_ok([sys.executable, "-m", "pip", "wheel", "-q", "-w", wheels, f"{src}[demo,gcs]"])
    report(f"wheel directory: {time.monotonic() - start:.0f} s, "
           f"{len(list(wheels.glob('*.whl')))} wheels")
