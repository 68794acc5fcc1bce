"""actx: activations of language models at pod scale, stored as zarr v3 with provenance.

The names a researcher types most, from one import:

    import actx
    run = actx.open_run("runs/demo")
    with run.stream("layers.1.resid_post", batch_size=4096, seed=0) as batches:
        for batch in batches:
            train_step(batch.acts["layers.1.resid_post"])

Reading: `open_run`, `open_runs`, `aligned_stream`, the keyword groups `run.stream` and
`run.batches` share (`TokenOptions`, `OrderOptions`, `OutputOptions`), and the trainers'
hand-offs `ActivationDataset` (a torch IterableDataset) and `export_saelens`. Extracting
in your own JAX code: `load_pretrained`, `CaptureSpec`, `make_extract_fn`.

Every name is imported when first used, so `import actx` imports neither torch nor jax,
nor Apache Beam. The deeper modules keep their full paths: `actx.reader`, `actx.workers`,
`actx.pipeline`, `actx.schemas`, `actx.deploy`, `actx.adapters`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

SUBPACKAGES = ("schemas", "pipeline", "workers", "deploy", "reader", "adapters")


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds actx.X in a source checkout's folder X/, for the six subpackages only.

    In a checkout the subpackages are the project card's top-level folders, beside this
    one; setup.py maps them onto actx.X the same way when it installs. This finder lets
    `python -m actx.deploy.cli` run from the checkout's root (where this folder comes first
    on sys.path) with or without an install, and maps nothing else: the checkout's other
    entries (setup.py, tests/, bench/) are not part of actx. An installed actx holds its
    subpackages in this folder, and this finder is not used."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in SUBPACKAGES:
            return None  # deeper modules follow their subpackage's __path__
        folder = os.path.join(self.root, name)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])


# realpath: a worker may import this folder through a link to it (deploy.config.code_path).
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if (os.path.isfile(os.path.join(_CHECKOUT, "setup.py"))
        and os.path.isfile(os.path.join(_CHECKOUT, "schemas", "version.py"))
        and not any(getattr(f, "root", None) == _CHECKOUT and type(f).__name__ == "_CheckoutFinder"
                    for f in sys.meta_path)):  # once, should actx be imported again
    sys.meta_path.append(_CheckoutFinder(_CHECKOUT))

from actx.schemas.version import VERSION as __version__  # noqa: E402

# name -> (module, attribute): the front door, imported on first use (PEP 562).
_FRONT_DOOR = {
    "open_run": ("actx.reader.run", "open_run"),
    "open_runs": ("actx.reader.aligned", "open_runs"),
    "aligned_stream": ("actx.reader.aligned", "aligned_stream"),
    "TokenOptions": ("actx.reader.options", "TokenOptions"),
    "OrderOptions": ("actx.reader.options", "OrderOptions"),
    "OutputOptions": ("actx.reader.options", "OutputOptions"),
    "ActivationDataset": ("actx.reader.torch_data", "ActivationDataset"),
    "export_saelens": ("actx.reader.trainers", "export_saelens"),
    "load_pretrained": ("actx.workers.model.decoder", "load_pretrained"),
    "CaptureSpec": ("actx.workers.model.capture", "CaptureSpec"),
    "make_extract_fn": ("actx.workers.model.step", "make_extract_fn"),
}

__all__ = ["__version__", *_FRONT_DOOR]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports them
    from actx.reader.aligned import aligned_stream, open_runs
    from actx.reader.options import OrderOptions, OutputOptions, TokenOptions
    from actx.reader.run import open_run
    from actx.reader.torch_data import ActivationDataset
    from actx.reader.trainers import export_saelens
    from actx.workers.model.capture import CaptureSpec
    from actx.workers.model.decoder import load_pretrained
    from actx.workers.model.step import make_extract_fn


def __getattr__(name: str) -> Any:
    if name in _FRONT_DOOR:
        module, attribute = _FRONT_DOOR[name]
        value = getattr(importlib.import_module(module), attribute)
    elif name in SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'actx' has no attribute {name!r}; its front door "
                             f"is {', '.join(__all__)}, its packages actx.{{"
                             f"{','.join(SUBPACKAGES)}}}")
    globals()[name] = value  # once imported, found without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FRONT_DOOR, *SUBPACKAGES})
