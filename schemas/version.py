"""actx's version, defined once: setup.py reads VERSION from this file, commit markers and
the TPU install record `code_version()`."""

from __future__ import annotations

import os

VERSION = "0.3.0"
# The distribution's name on PyPI (`pip install actx-lm`): `actx` there is another project.
# The import package and the command are actx.
DISTRIBUTION = "actx-lm"


def code_version() -> str:
    """ACTX_CODE_VERSION when a launcher sets it, else the installed distribution's version,
    else VERSION (running from a source checkout)."""
    if os.environ.get("ACTX_CODE_VERSION"):
        return os.environ["ACTX_CODE_VERSION"]
    try:
        from importlib import metadata

        return metadata.version(DISTRIBUTION)
    except Exception:  # not installed as a distribution
        return VERSION
