"""The Dataflow worker images of `target.extract: beam` (deploy/containers/): built from
Beam's SDK image of the launcher's Beam version, with actx's own extras and JAX for the
accelerator; the pip step resolves (with ACTX_INSTALL_TESTS=1, which reaches PyPI) without
a container tool."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.setup_extras import dev_pin, setup_extras

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = {"gpu": "jax[cuda12]", "tpu": "jax[tpu]"}


def _dockerfile(kind: str) -> str:
    with open(os.path.join(REPO, "deploy", "containers", f"Dockerfile.{kind}")) as f:
        return f.read()


def _pip_requirements(text: str) -> list[str]:
    [line] = [l for l in text.splitlines() if l.startswith("RUN pip install")]
    return re.findall(r'"([^"]+)"', line)


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_image_is_beams_sdk_with_actx_extras_and_jax(kind):
    import apache_beam
    import jax

    text = _dockerfile(kind)
    assert "FROM apache/beam_python3.11_sdk:${BEAM_VERSION}" in text
    default = re.search(r"^ARG BEAM_VERSION=(\S+)$", text, re.M).group(1)
    # The Beam these tests launch with: the dev extra pins it, so a new Beam release
    # cannot drift the tests away from the image.
    assert default == dev_pin("apache-beam") == apache_beam.__version__
    actx_req, jax_req = _pip_requirements(text)
    extras = re.fullmatch(r"/opt/actx\[([a-z,]+)\]", actx_req).group(1).split(",")
    assert set(extras) <= set(setup_extras()) and "workers" in extras
    # The JAX the tests ran, pinned the same way.
    assert jax_req == f"{IMAGES[kind]}=={dev_pin('jax')}"
    assert dev_pin("jax") == jax.__version__
    assert "COPY . /opt/actx" in text


@pytest.mark.skipif(not os.environ.get("ACTX_INSTALL_TESTS"),
                    reason="resolves against PyPI; set ACTX_INSTALL_TESTS=1")
@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_image_requirements_resolve(kind, tmp_path):
    actx_req, jax_req = _pip_requirements(_dockerfile(kind))
    local = actx_req.replace("/opt/actx", REPO)
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "--quiet", "--report", str(report), local, jax_req], check=True,
                   timeout=600)
    import json

    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert {"actx-lm", "jax", "jaxlib", "safetensors", "tensorstore"} <= names
