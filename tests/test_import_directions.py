"""The import directions of docs/ARCHITECTURE.md are part of the architecture; this test holds them.

schemas imports neither jax nor apache_beam; pipeline never imports jax; workers never
import apache_beam; adapters/ (the Beam extraction transform) is the one place that imports
both; deploy reaches pipeline, workers and adapters only through their entry points;
the reader pulls in neither Beam nor (at import time) JAX.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "schemas": {"jax", "jaxlib", "flax", "apache_beam", "pipeline", "workers", "deploy", "reader",
                "adapters"},
    "pipeline": {"jax", "jaxlib", "flax", "workers", "deploy", "reader", "adapters"},
    "workers": {"apache_beam", "pipeline", "deploy", "reader", "adapters"},
    "reader": {"apache_beam", "pipeline", "workers", "deploy", "adapters"},
    # The one place that imports both Beam and JAX (through the workers' runner).
    "adapters": {"deploy", "reader"},
}
ENTRY_POINTS = {"pipeline.main", "workers.main", "adapters.beam_extract"}


def _imports(path: pathlib.Path, top_level_only: bool = False):
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _files(package: str):
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_design(package):
    violations = []
    for path in _files(package):
        for lineno, name in _imports(path):
            if name.split(".")[0] in FORBIDDEN[package]:
                violations.append(f"{path.relative_to(REPO)}:{lineno} imports {name}")
    assert not violations, "\n".join(violations)


def test_deploy_uses_only_entry_points():
    violations = []
    for path in _files("deploy"):
        for lineno, name in _imports(path):
            root = name.split(".")[0]
            if root in ("pipeline", "workers", "adapters") and not any(
                    name == e or name.startswith(e + ".") or e.startswith(name)
                    for e in ENTRY_POINTS):
                violations.append(f"{path.relative_to(REPO)}:{lineno} imports {name}")
    assert not violations, "\n".join(violations)


def test_reader_and_schemas_load_without_jax_or_beam():
    code = ("import sys, schemas.runspec, schemas.layout, schemas.commit, schemas.store, "
            "schemas.manifest, reader; "
            "bad = [m for m in ('jax', 'apache_beam') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
