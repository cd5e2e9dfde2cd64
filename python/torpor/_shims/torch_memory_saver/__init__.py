"""torch_memory_saver resolved to torpor's torch_memory_saver mode (torpor.tms). This directory is
on PYTHONPATH only when asked for (``python3 -m torpor.tms --shim-path``, or inside
torpor.tms.configure_subprocess()); see torpor/tms/. The submodules torch_memory_saver's own
tests import (testing_utils, utils) are here too, so its test/test_examples.py runs unmodified."""

from . import testing_utils, utils  # noqa: F401  (registered as torch_memory_saver.* before the swap)
from torpor.tms import TorchMemorySaver, configure_subprocess, torch_memory_saver  # noqa: F401
from torpor.tms import install as _install

_install()  # `torch_memory_saver` and `torch_memory_saver.entrypoint` are torpor.tms from now on
