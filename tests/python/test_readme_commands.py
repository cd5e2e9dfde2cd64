"""The README's two commands are what users and CI run: the main command builds only what the
main job (torpor stress) needs, and .ci/run is exactly the README's test command."""

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
