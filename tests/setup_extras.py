"""setup.py's extras, as the tests that check what is installed against them read them."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def setup_extras() -> dict[str, list[str]]:
    """setup.py's extras_require, read by running setup.py with setup() replaced."""
    import setuptools

    captured: dict = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        source = (REPO / "setup.py").read_text()
        exec(compile(source, str(REPO / "setup.py"), "exec"),
             {"__file__": str(REPO / "setup.py"), "__name__": "setup"})
    finally:
        setuptools.setup = real
    return captured["extras_require"]


def dev_pin(name: str) -> str:
    """The exact version the dev extra pins `name` to (`name==X`)."""
    [pin] = [r.split("==")[1] for r in setup_extras()["dev"] if r.startswith(f"{name}==")]
    return pin
