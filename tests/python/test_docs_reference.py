"""The reference pages against what they describe. docs/reference/configuration.md: its pool options
against the PoolOptions struct of the public headers (every field, its default), its Python
variables against torpor.environment's table; docs/reference/cli.md against `torpor --help` and
each command's --help (every command and flag, the defaults the help prints). The environment
variables of the library are checked by Options.ReadmeConfigurationTableMatches
(tests/allocator/test_options.cpp) against the C options table itself."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

from conftest import REPO
from torpor import environment

CONFIGURATION = REPO / "docs" / "reference" / "configuration.md"
CLI = REPO / "docs" / "reference" / "cli.md"
PUBLIC = REPO / "allocator" / "include" / "torpor"


def section(path: pathlib.Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    assert f"\n{heading}\n" in text, f"{path.name} has no section {heading!r}"
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def table_rows(text: str, first_column: str | None = None) -> list[list[str]]:
    """The rows (header and rule left out) of the first table in text, or of the first whose
    header's first cell is first_column, as stripped cells."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    for t in tables:
        if first_column is None or t[0][0] == first_column:
            return t[2:]
    pytest.fail(f"no table with a {first_column!r} column")


# -- pool options ----------------------------------------------------------------------------


def pool_options_fields() -> dict[str, str]:
    """PoolOptions' data members and their initializers ('' for none), read from whichever public
    header declares the struct."""
    for header in sorted(PUBLIC.glob("*.hpp")):
        text = header.read_text(encoding="utf-8")
        m = re.search(r"\bstruct PoolOptions\s*\{", text)
        if m:
            break
    else:
        pytest.fail("no public header declares struct PoolOptions")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    body = re.sub(r"//[^\n]*|/\*.*?\*/", "", text[m.end() : i - 1], flags=re.S)
    fields = {}
    for statement in body.split(";"):
        s = " ".join(statement.split())
        if not s or "(" in s or s.startswith(("static", "using", "friend")):
            continue
        decl, _, init = s.partition("=")
        brace = re.fullmatch(r"(.*?\w)\s*\{(.*)\}", decl.strip())
        if brace and not init:
            decl, init = brace.group(1), brace.group(2)
        fields[decl.split()[-1]] = init.strip()
    return fields


def cpp_value(init: str):
    """An initializer's value: a number (std::size_t{N} << M and the like), a bool, an
    enumerator's name, or None for an empty container or string."""
    if init in ("", "{}"):
        return None
    if init in ("true", "false"):
        return init == "true"
    if re.fullmatch(r"\w+::\w+", init):
        return init.split("::")[1]
    expr = re.sub(r"std::size_t\{(\d+)\}", r"\1", init)
    assert re.fullmatch(r"[\d\s<>*+()]+", expr), f"an initializer the test cannot read: {init!r}"
    return eval(expr)  # noqa: S307 - digits and operators only, checked above


def doc_value(cell: str):
    if cell == "empty":
        return None
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"a default the test cannot read: {cell!r}"
    v = m.group(1)
    if v in ("true", "false"):
        return v == "true"
    size = re.fullmatch(r"(\d+)([KMGT]?)", v)
    if size:
        return int(size.group(1)) << (10 * " KMGT".index(size.group(2) or " "))
    return v


def test_pool_options_are_the_structs_fields_with_its_defaults():
    fields = pool_options_fields()
    assert len(fields) > 20 and "copy_piece_bytes" in fields
    rows = table_rows(section(CONFIGURATION, "## Pool options"))
    documented = {re.fullmatch(r"`(\w+)`", r[0]).group(1): doc_value(r[1]) for r in rows}
    assert sorted(documented) == sorted(fields)
    assert documented == {name: cpp_value(init) for name, init in fields.items()}


def test_the_field_reader_reads_defaults():
    assert cpp_value("std::size_t{256} << 20") == 256 << 20
    assert cpp_value("FillOnWake::none") == "none"
    assert doc_value("`256M`") == 256 << 20 and doc_value("empty") is None and doc_value("`false`") is False


# -- the Python package's variables --------------------------------------------------------


def test_every_variable_the_package_reads_is_documented():
    python_table = {
        name
        for r in table_rows(section(CONFIGURATION, "## The Python package's variables"))
        for name in re.findall(r"`([A-Z_]+)`", r[0])
    }
    library_table = {r[0].strip("`") for r in table_rows(section(CONFIGURATION, "## Environment variables"))}
    package = {v.name for v in environment.VARIABLES}
    assert sorted(package - python_table - library_table) == []
    # and a variable listed for the package is one it or the library reads
    assert sorted(python_table - package - library_table) == []


# -- the CLI ---------------------------------------------------------------------------------


def cli_path():
    """The torpor CLI of the build whose library the tests load (TORPOR_LIBRARY is
    BUILD/allocator/libtorpor.so; the CLI is BUILD/tools/torpor)."""
    library = os.environ.get("TORPOR_LIBRARY")
    cli = pathlib.Path(library).resolve().parents[1] / "tools" / "torpor" if library else None
    if not cli or not cli.is_file():
        pytest.skip(f"no torpor CLI beside TORPOR_LIBRARY={library} (a build without tools)")
    return cli


def help_text(*command) -> str:
    out = subprocess.run([str(cli_path()), *command, "--help"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def help_groups(text: str) -> dict[str, dict[str, str | None]]:
    """CLI11's help: per group ('Options', 'Model', ...), each long flag and the default it
    prints (`=VALUE`), or None."""
    groups, current = {}, None
    for line in text.splitlines():
        m = re.fullmatch(r"(\w[\w ]*):", line.strip())
        if m and not line.startswith(" "):
            current = groups.setdefault(m.group(1), {})
            continue
        # the flag, its type (`INT:INT in [1 - 86400]`, `TEXT:{auto,host,cuda}`) and its default
        flag = re.match(r"\s+(?:-\w,)?(--[\w-]+)(?: [A-Z][\w:{},.-]*(?: in \[[^\]]*\])?(?:=(\S+))?)?", line)
        if current is not None and flag and flag.group(1) not in ("--help", "--version"):
            current[flag.group(1)] = flag.group(2)
    return groups


def subcommands() -> list[str]:
    text = help_text().split("Subcommands:", 1)[1]
    return re.findall(r"^  (\S+)\s", text, re.M)


def doc_flags(heading: str) -> dict[str, str]:
    return {re.fullmatch(r"`(--[\w-]+)`", r[0]).group(1): r[1] for r in table_rows(section(CLI, heading), "flag")}


def check_flags(helped: dict[str, str | None], documented: dict[str, str], where: str):
    assert sorted(documented) == sorted(helped), where
    for flag, default in helped.items():
        if default is not None:
            assert documented[flag] == f"`{default}`", f"{where} {flag}: the help says {default}"


def test_every_command_has_a_section():
    commands = subcommands()
    assert "stress" in commands and "doctor" in commands
    text = CLI.read_text(encoding="utf-8")
    assert sorted(re.findall(r"^## `torpor ([\w-]+)`$", text, re.M)) == sorted(commands)


def test_every_flag_and_default_is_the_helps():
    model = doc_flags("## Model flags")
    for command in subcommands():
        groups = help_groups(help_text(command))
        check_flags(groups.pop("Options"), doc_flags(f"## `torpor {command}`"), command)
        if "Model" in groups:
            check_flags(groups.pop("Model"), model, f"{command} (model flags)")
        assert groups == {}, f"{command}: help groups the page does not cover: {sorted(groups)}"
