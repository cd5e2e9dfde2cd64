"""The Python package's constants agree with the C and C++ headers, which are the oracle here:
parsed from the source tree, not taken from the library or the package."""

import re

import torpor
from conftest import REPO

INCLUDE = REPO / "allocator" / "include" / "torpor"


def test_the_tag_names_are_the_cpp_apis():
    cpp = dict(re.findall(r'inline constexpr char (\w+)\[\] = "([^"]*)";', (INCLUDE / "tags.hpp").read_text()))
    c = dict(re.findall(r'#define TORPOR_TAG_(\w+) "([^"]*)"', (INCLUDE / "torpor.h").read_text()))
    assert cpp and {k.upper(): v for k, v in cpp.items()} == c, "tags.hpp and torpor.h name the same tags"
    py = {name: getattr(torpor.tags, name) for name in torpor.tags.__all__}
    assert py == c
