"""torpor's version, read from the one place it is written: the repository's VERSION file.

An installed package carries a copy (``torpor/VERSION``, put there by the build, setup.py); a
checkout used through PYTHONPATH reads the repository's own. CMake reads the same file for the
library (``torpor_version()``, ``torpor.library_version()``) and the CLI (``torpor --version``);
the ctest ``version.agree`` and tests/python/test_version.py check that they agree.
"""

from __future__ import annotations

import pathlib

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# Bundled copy first: an installed package must report its own version, not a checkout's.
_CANDIDATES = (_PACKAGE_DIR / "VERSION", _PACKAGE_DIR.parent.parent / "VERSION")


def read_version() -> str:
    """The first line of the first VERSION file found; "0+unknown" when there is none (a package
    copied without it: `import torpor` never fails for want of a version)."""
    for path in _CANDIDATES:
        try:
            text = path.read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if text:
            return text.splitlines()[0].strip()
    return "0+unknown"


VERSION = read_version()
