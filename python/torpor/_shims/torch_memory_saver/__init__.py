"""torch_memory_saver resolved to torpor's torch_memory_saver mode (torpor.tms). This directory is
on PYTHONPATH only when asked for (``python3 -m torpor.tms --shim-path``, or inside
torpor.tms.configure_subprocess()); see torpor/tms.py."""

from torpor.tms import TorchMemorySaver, configure_subprocess, torch_memory_saver  # noqa: F401
from torpor.tms import install as _install

_install()  # `torch_memory_saver` and `torch_memory_saver.entrypoint` are torpor.tms from now on
