"""The wheel that TPU hosts install: built from the actx this machine runs, in a directory
of its own, never in the user's tree.

From a source checkout (setup.py beside the packages) its packages and setup.py are copied
to a temporary directory and built there with pip, so no dist/, build/ or egg-info lands in
the checkout. From a pip-installed actx (no setup.py) the installed files and metadata are
packed back into a wheel. Either way the hosts run the code the submitter runs.

`python -m actx.deploy.targets.tpu_vm.package --out DIR` prints the wheel's path (the submit
plan runs it).
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from actx.schemas import version as version_lib

PACKAGE = "actx"  # the one import package the wheel holds
# The checkout's folders the hosts' wheel is built from: the front door (actx/) and the
# subpackages they run (setup.py installs each folder X as actx.X; no adapters, no Beam).
FOLDERS = ("actx", "schemas", "pipeline", "workers", "deploy", "reader")
# Where this file's actx comes from: a checkout's root (setup.py beside the folders), or
# an installed package's directory (site-packages/actx, no setup.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
# This machine's build of actx.reader._row_copy would not fit the hosts' platform: their
# wheel is pure Python (setup.py's ACTX_PURE_WHEEL), and their reader copies with numpy.
_NATIVE = ("*.so", "*.pyd", "*.dylib")


def _dist_stem(version: str) -> str:
    """The distribution's name and version as wheel and dist-info names spell them."""
    return f"{version_lib.DISTRIBUTION.replace('-', '_')}-{version}"


def wheel_name(version: str) -> str:
    return f"{_dist_stem(version)}-py3-none-any.whl"


def dist_info_dir(version: str) -> str:
    return f"{_dist_stem(version)}.dist-info"


def is_checkout(root: str = ROOT) -> bool:
    return os.path.isfile(os.path.join(root, "setup.py"))


def package_version(root: str = ROOT) -> str:
    """The version of the wheel `build` makes (its file name is known before it exists)."""
    if is_checkout(root):
        return version_lib.VERSION
    from importlib import metadata

    return metadata.version(version_lib.DISTRIBUTION)


def build(out_dir: str, root: str = ROOT) -> str:
    """Builds actx's wheel into `out_dir` (created) and returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    if is_checkout(root):
        return _from_checkout(root, out_dir)
    return _from_installed(out_dir)


def _from_checkout(root: str, out_dir: str) -> str:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", *_NATIVE)
    with tempfile.TemporaryDirectory(prefix="actx-src-") as src:
        shutil.copy2(os.path.join(root, "setup.py"), src)
        for name in FOLDERS:
            if os.path.isdir(os.path.join(root, name)):
                shutil.copytree(os.path.join(root, name), os.path.join(src, name),
                                ignore=ignore)
        # No build isolation: setuptools is here, and the hosts' index may not be.
        res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                              "--no-build-isolation", "-q", "-w", out_dir, src],
                             capture_output=True, text=True,
                             env={**os.environ, "ACTX_PURE_WHEEL": "1"})
        if res.returncode != 0:
            raise RuntimeError(f"building actx's wheel from {root} failed:\n"
                               f"{res.stderr[-3000:]}")
    path = os.path.join(out_dir, wheel_name(version_lib.VERSION))
    if not os.path.isfile(path):
        raise RuntimeError(f"pip built no {os.path.basename(path)} in {out_dir}")
    return path


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _from_installed(out_dir: str) -> str:
    """Packs the installed distribution's package files and metadata into a wheel."""
    from importlib import metadata

    dist = metadata.distribution(version_lib.DISTRIBUTION)
    info_dir = dist_info_dir(dist.version)
    dropped = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    path = os.path.join(out_dir, wheel_name(dist.version))
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(dist.files or [], key=str):
            parts = f.parts
            keep = (parts[0] == PACKAGE and (len(parts) == 2 or parts[1] in FOLDERS)
                    and "__pycache__" not in parts
                    and not any(fnmatch.fnmatch(parts[-1], p) for p in _NATIVE)) or (
                parts[0] == info_dir and parts[-1] not in dropped)
            if not keep:
                continue
            data = f.locate().read_bytes()
            zf.writestr(str(f), data)
            record.append(f"{f},{_record_hash(data)},{len(data)}")
        if not any(r.startswith(f"{info_dir}/WHEEL,") for r in record):
            wheel = b"Wheel-Version: 1.0\nGenerator: actx\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            zf.writestr(f"{info_dir}/WHEEL", wheel)
            record.append(f"{info_dir}/WHEEL,{_record_hash(wheel)},{len(wheel)}")
        record.append(f"{info_dir}/RECORD,,")
        zf.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    if not any(r.startswith(f"{PACKAGE}/deploy/") for r in record):
        raise RuntimeError(f"the installed actx ({dist.locate_file('')}) lists no package "
                           f"files; reinstall it with pip")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m actx.deploy.targets.tpu_vm.package",
                                description=__doc__)
    p.add_argument("--out", required=True, help="directory for the wheel (created)")
    args = p.parse_args(argv)
    print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
