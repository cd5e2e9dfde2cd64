"""Making ``import torch_memory_saver`` resolve to torpor.tms (opt-in): ``install()`` in this
process, ``shim_path()`` first on PYTHONPATH for a process and its children (the directory's
``torch_memory_saver`` package, python/torpor/_shims, installs it and carries the submodules
torch_memory_saver's own tests import), and ``configure_subprocess()`` for the children started
inside a block, with libtorpor_preload.so first on LD_PRELOAD as torch_memory_saver's own.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import sys

from .. import environment
from ..errors import LibraryNotFound
from .library import preload_library_path

logger = logging.getLogger(__name__)

SHIM_DIR = pathlib.Path(__file__).resolve().parent.parent / "_shims"


def shim_path() -> str:
    """A directory whose ``torch_memory_saver`` package is torpor.tms: put it first on PYTHONPATH."""
    return str(SHIM_DIR)


def install() -> None:
    """Make ``import torch_memory_saver`` (and ``torch_memory_saver.entrypoint``) resolve to
    torpor.tms in this process. Call before the engine imports torch_memory_saver."""
    package = sys.modules[__package__]  # torpor.tms: the public API, whatever module defines it
    sys.modules["torch_memory_saver"] = package
    sys.modules["torch_memory_saver.entrypoint"] = package


@contextlib.contextmanager
def configure_subprocess():
    """Child processes started inside resolve ``import torch_memory_saver`` to torpor.tms and, as
    torch_memory_saver's configure_subprocess does for its own binary, start with
    libtorpor_preload.so first on LD_PRELOAD (hook_mode "preload", its default and SGLang's).
    Without the preload library (not built) the children get only the shim, and a warning says so."""
    with environment.prepended_path("PYTHONPATH", shim_path()):
        try:
            preload = preload_library_path()
        except LibraryNotFound as e:
            logger.warning("torpor.tms.configure_subprocess: %s; children can use hook_mode='torch' only", e)
            yield
            return
        with environment.prepended_path("LD_PRELOAD", preload, separator=":"):
            yield


__all__ = ["SHIM_DIR", "configure_subprocess", "install", "shim_path"]
