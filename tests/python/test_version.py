"""One version: torpor.__version__ and the loaded library's torpor_version() are what the
repository's VERSION file says (the CLI and the CMake package are checked by ctest version.agree)."""

import re

import torpor
from conftest import REPO


def version_file() -> str:
    return (REPO / "VERSION").read_text(encoding="utf-8").splitlines()[0].strip()


def test_version_file_is_major_minor_patch():
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", version_file())


def test_package_version_is_the_version_file():
    assert torpor.__version__ == version_file()


def test_library_version_is_the_version_file():
    assert torpor.library_version() == version_file()


def test_no_version_written_by_hand_in_the_package_metadata():
    # pyproject.toml takes its version from setup.py, which reads VERSION.
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r"^version\s*=", project, re.M) is None
    assert re.search(r'^dynamic\s*=\s*\[[^\]]*"version"', project, re.M)
