"""The import directions of docs/ARCHITECTURE.md are part of the architecture; this test holds them.

actx.schemas imports neither jax nor apache_beam; actx.pipeline never imports jax;
actx.workers never import apache_beam; actx.adapters (the Beam extraction transform) is the
one place that imports both; actx.deploy reaches actx.pipeline, actx.workers and
actx.adapters only through their entry points; the reader pulls in neither Beam nor (at
import time) JAX. The folders are the project card's (schemas/, workers/, ...); installed,
each is a subpackage of actx, and nothing imports them by their old top-level names.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SUBPACKAGES = ("schemas", "pipeline", "workers", "deploy", "reader", "adapters")

# Per subpackage folder: what it must not import. Bare names are third-party packages;
# subpackages are named as imported, actx.X.
FORBIDDEN = {
    "schemas": {"jax", "jaxlib", "flax", "apache_beam", "actx.pipeline", "actx.workers",
                "actx.deploy", "actx.reader", "actx.adapters"},
    "pipeline": {"jax", "jaxlib", "flax", "actx.workers", "actx.deploy", "actx.reader",
                 "actx.adapters"},
    "workers": {"apache_beam", "actx.pipeline", "actx.deploy", "actx.reader", "actx.adapters"},
    "reader": {"apache_beam", "actx.pipeline", "actx.workers", "actx.deploy", "actx.adapters"},
    # The one place that imports both Beam and JAX (through the workers' runner).
    "adapters": {"actx.deploy", "actx.reader"},
}
# deploy's doors into the layers below: the prepare and worker commands, the Beam transform,
# and the two pre-flights submit runs before any work (the inputs and tokenizer; the job
# and hook shapes).
ENTRY_POINTS = {"actx.pipeline.main", "actx.pipeline.preflight", "actx.workers.main",
                "actx.workers.preflight", "actx.adapters.beam_extract"}
# The front door (`import actx`, its names imported on first use) is for users: inside
# actx a module imports another by its full name, so the rules above see what it pulls in.
FRONT_DOOR = {"open_run", "open_runs", "aligned_stream", "TokenOptions", "OrderOptions",
              "OutputOptions", "ActivationDataset", "export_saelens", "load_pretrained",
              "CaptureSpec", "make_extract_fn"}


def _module_name(path: pathlib.Path) -> str:
    """The installed name of a file: schemas/x.py is actx.schemas.x (tests/ keeps its own)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["actx", *parts] if parts[0] in SUBPACKAGES else parts)


def _imports(path: pathlib.Path, top_level_only: bool = False):
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: what it names once installed
                package = _module_name(path)
                if path.name != "__init__.py":
                    package = package.rpartition(".")[0]
                module = importlib.util.resolve_name("." * node.level + module, package)
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _root(name: str) -> str:
    """The unit an import rule speaks of: actx.X for actx's subpackages, else the top name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "actx" and len(parts) > 1 else parts[0]


def _files(package: str):
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_follow_design(package):
    violations = []
    for path in _files(package):
        for lineno, name in _imports(path):
            if _root(name) in FORBIDDEN[package]:
                violations.append(f"{path.relative_to(REPO)}:{lineno} imports {name}")
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_subpackages_import_modules_not_the_front_door(package):
    violations = []
    for path in _files(package):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name == "actx"]
            elif isinstance(node, ast.ImportFrom) and node.module == "actx" and not node.level:
                names = [f"actx.{a.name}" for a in node.names if a.name not in SUBPACKAGES]
            else:
                continue
            violations += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names]
    assert not violations, "\n".join(violations)


def test_the_front_door_lists_what_this_test_holds():
    import actx

    assert set(actx._FRONT_DOOR) == FRONT_DOOR and set(actx.SUBPACKAGES) == set(SUBPACKAGES)


def test_deploy_uses_only_entry_points():
    violations = []
    for path in _files("deploy"):
        for lineno, name in _imports(path):
            if _root(name) in ("actx.pipeline", "actx.workers", "actx.adapters") and not any(
                    name == e or name.startswith(e + ".") or e.startswith(name)
                    for e in ENTRY_POINTS):
                violations.append(f"{path.relative_to(REPO)}:{lineno} imports {name}")
    assert not violations, "\n".join(violations)


def test_reader_and_schemas_load_without_jax_or_beam():
    code = ("import sys, actx, actx.schemas.runspec, actx.schemas.layout, actx.schemas.commit, "
            "actx.schemas.store, actx.schemas.manifest, actx.reader; actx.open_run; "
            "bad = [m for m in ('jax', 'apache_beam') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def _python_files():
    """The project's own Python files: not virtual environments, build output or hidden
    folders that may lie in a checkout, nor the fixture an old actx wrote."""
    skip = {"build", "dist", "node_modules", "site-packages", "old_runs"}

    def walk(folder: pathlib.Path):
        if (folder / "pyvenv.cfg").exists():
            return
        for entry in sorted(folder.iterdir()):
            if entry.is_dir() and not entry.name.startswith(".") and entry.name not in skip:
                yield from walk(entry)
            elif entry.suffix == ".py":
                yield entry

    yield from walk(REPO)


def _module_exists(dotted: str) -> bool:
    """Whether actx.<dotted> is a module of this checkout (found by file, not imported)."""
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


OLD_MODULE_PATH = re.compile(r"(?:schemas|pipeline|workers|deploy|reader|adapters)(?:\.\w+)*")


def test_nothing_imports_the_old_top_level_names():
    """Every import of actx's own code names actx.X, and so does every string that names
    one of its modules (`python -m`, importlib): the folders are not packages of their own
    once installed, and PyPI has other packages by those names."""
    violations = []
    for path in _python_files():
        violations += [f"{path.relative_to(REPO)}:{lineno} imports {name}"
                       for lineno, name in _imports(path) if name.split(".")[0] in SUBPACKAGES]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and OLD_MODULE_PATH.fullmatch(node.value) and "." in node.value
                    and _module_exists(node.value)):
                violations.append(f"{path.relative_to(REPO)}:{node.lineno} names module "
                                  f"{node.value!r}; installed it is 'actx.{node.value}'")
    assert not violations, "\n".join(violations)


def test_the_old_top_level_names_are_not_installed(tmp_path):
    """From outside the checkout, `import reader` (or any old name) finds no actx code: the
    installed distribution puts actx and nothing else at the top level."""
    code = ("import importlib.util, json; "
            f"print(json.dumps({{n: getattr(importlib.util.find_spec(n), 'origin', None) "
            f"for n in {SUBPACKAGES!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True,
                         capture_output=True, text=True).stdout
    found = {n: o for n, o in json.loads(out).items() if o and o.startswith(str(REPO))}
    assert not found, f"actx's folders importable at the top level: {found}"
    # Nor does any installed distribution of actx (this one, or an old `actx` left behind)
    # own a top-level name but actx.
    code = ("import importlib.metadata as md, json; "
            "print(json.dumps({n: d for n, d in md.packages_distributions().items() "
            "if {x.lower().replace('_', '-') for x in d} & {'actx', 'actx-lm'}}))")
    owned = json.loads(subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True,
                                      capture_output=True, text=True).stdout)
    assert set(owned) <= {"actx"}, f"installed at the top level by actx: {owned}"


def test_the_front_door_is_light_and_documented():
    """`import actx` imports neither torch, jax nor Beam; every front-door name resolves to
    an object with a docstring, and importing it pulls in only what it needs."""
    code = ("import sys, actx; "
            "assert not [m for m in ('jax', 'torch', 'apache_beam') if m in sys.modules]; "
            "names = [n for n in actx.__all__ if n != '__version__']; "
            "missing = [n for n in names if not (getattr(actx, n).__doc__ or '').strip()]; "
            "assert not missing, missing; "
            "from actx.schemas import version; assert actx.__version__ == version.VERSION; "
            "print(sorted(names))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=REPO).stdout
    assert ast.literal_eval(out) == sorted([
        "ActivationDataset", "CaptureSpec", "OrderOptions", "OutputOptions", "TokenOptions",
        "aligned_stream", "export_saelens", "load_pretrained", "make_extract_fn", "open_run",
        "open_runs"])
    reader_only = ("import sys, actx; actx.open_run; actx.aligned_stream; actx.TokenOptions; "
                   "print([m for m in ('jax', 'torch', 'apache_beam') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", reader_only], check=True, capture_output=True,
                         text=True, cwd=REPO).stdout
    assert out.strip() == "[]"


# ---- no import circle between modules ------------------------------------------------------
# Counted as Python would resolve every import statement anywhere in a module: at the top,
# inside a function (imported when called) and under TYPE_CHECKING (imported by the type
# checker). A circle means its modules cannot be understood or tested apart, and an import
# inside a function is how such a circle stays out of sight; so none is allowed.

def _module_sources(root: pathlib.Path = REPO) -> dict[str, str]:
    """actx's modules by installed name (the front door and the six subpackages) -> source."""
    found = {}
    for folder in ("actx", *SUBPACKAGES):
        for path in sorted((root / folder).rglob("*.py")):
            name = "actx" if folder == "actx" and path.name == "__init__.py" else (
                _module_name(path) if folder != "actx" else
                "actx." + ".".join(path.relative_to(root / "actx").with_suffix("").parts))
            found[name] = path.read_text()
    return found


def _import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the actx modules it imports: `from a.b import c` names the module a.b.c
    where that is one (a submodule, not a name the package holds), else a.b."""
    modules = set(sources)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, text in sources.items():
        is_package = module == "actx" or (REPO / module.removeprefix("actx.").replace(
            ".", "/") / "__init__.py").is_file()
        for node in ast.walk(ast.parse(text, module)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module if is_package else module.rpartition(".")[0]
                    base = importlib.util.resolve_name("." * node.level + base, package)
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in modules]
                if len(targets) < len(subs):
                    targets.append(base)
            else:
                continue
            for target in targets:
                found = known(target) if target.split(".")[0] == "actx" else None
                if found and found != module:
                    graph[module].add(found)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_no_import_circle_between_modules():
    circles = _circles(_import_graph(_module_sources()))
    assert not circles, "import circles (counting imports inside functions and under " \
        "TYPE_CHECKING):\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("closing", [
    # An import inside a function, as `ModelConfig.from_hf` closed a circle once.
    "def _later():\n    from actx.workers.model import families\n    return families\n",
    # Under TYPE_CHECKING, as `runner` and `session` once named each other.
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
    "    from actx.workers.model.families import qwen\n",
    # A relative import, resolved as Python would.
    "def _later():\n    from . import families\n    return families\n",
])
def test_the_circle_rule_sees_a_circle_closed_out_of_sight(closing):
    """Mutation: the real sources, with the config importing a family back (the families
    import the config), out of sight of an import-time check. The rule finds the circle
    and names both ends."""
    sources = _module_sources()
    assert not _circles(_import_graph(sources))
    sources["actx.workers.model.config"] += "\n\n" + closing
    circles = _circles(_import_graph(sources))
    assert circles and any("actx.workers.model.config" in c
                           and any(m.startswith("actx.workers.model.families") for m in c)
                           for c in circles), circles


def test_the_circle_rule_tells_a_submodule_from_a_name_its_package_holds():
    """`from actx.schemas import layout` depends on the module layout, not on every module
    the package holds; a name that is no module is a dependency on the package itself."""
    graph = _import_graph({"actx.a": "from actx.b import c\nfrom actx.b import thing\n",
                           "actx.b": "", "actx.b.c": "from actx import a\n"})
    assert graph["actx.a"] == {"actx.b.c", "actx.b"} and graph["actx.b.c"] == {"actx.a"}
    assert _circles(graph) == [["actx.a", "actx.b.c"]]
