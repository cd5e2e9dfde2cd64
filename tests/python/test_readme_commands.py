"""The README's two commands are what users and CI run: the main command builds only what the
main job (torpor stress) needs, and .ci/run is exactly the README's test command. The README's C++
example is the one Readme.TenLineExample compiles and runs."""

import re

from conftest import REPO


def readme_commands():
    """The shell blocks of the README's Quick start, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", quick, re.S)]


def test_main_command_builds_the_cli_only():
    main = readme_commands()[0]
    builds = re.findall(r"cmake --build build\b([^&]*)", main)
    assert builds == [" --target torpor_cli "], f"the main command builds more than the CLI: {main}"
    assert main.endswith("build/tools/torpor stress")


def test_ci_runs_the_readme_test_command_exactly():
    test_command = readme_commands()[1]
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[-1] == test_command


def statements(code: str) -> list[str]:
    """C++ statements of a block, comments dropped and spaces normalised."""
    code = re.sub(r"/\*.*?\*/|//[^\n]*|^#[^\n]*", "", code, flags=re.S | re.M)
    return [" ".join(s.split()) for s in code.split(";") if s.strip()]


def test_the_cpp_example_is_the_one_the_test_compiles():
    """Readme.TenLineExample (tests/allocator/api/test_readme_example.cpp) compiles and runs the
    README's C++ lines on the host backend: each statement of the README's block is one of its
    statements, except the backend choice (the test names the host backend)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## C\+\+ in ten lines\n.*?```cpp\n(.*?)```", text, re.S).group(1)
    test = statements((REPO / "tests" / "allocator" / "api" / "test_readme_example.cpp").read_text(encoding="utf-8"))
    readme = statements(block)
    assert "auto sel = torpor::open_driver()" in readme
    missing = [s for s in readme if s not in test and s != "auto sel = torpor::open_driver()"]
    assert len(readme) >= 8 and missing == []
