"""docs/architecture.md states the dependency rule once; this reads the rule from that page and the
arrows from the code as it is, and fails on an arrow the rule forbids.

Oracles, independent of the page: the CMake files' `target_link_libraries` calls, the `#include`
lines of every source file, and the Python package's module-level imports. A file's module is the
first folder of its path; inside the allocator, a file's wing is the first folder of its path
under allocator/src/ (so the check holds whatever the rooms inside a wing are called)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from conftest import REPO

PAGE = REPO / "docs" / "architecture.md"
ALLOCATOR_SRC = REPO / "allocator" / "src"
# The source trees the modules' rule governs (tests/ may use anything; python/ is checked apart).
SOURCE_SUFFIXES = {".cpp", ".hpp", ".h", ".cu", ".cuh", ".in"}
SKIPPED = {REPO / "bench" / "results"}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


# -- the rule, from the page -----------------------------------------------------------------


def rule_chains() -> list[list[list[str]]]:
    """Every fenced block of the page whose lines are all chains `a, b -> c -> d`: per chain, its
    levels from the top, each level a list of names."""
    chains = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S):
        lines = [line.strip() for line in block.strip().splitlines()]
        level = r"[a-z_/]+(?:\s*,\s*[a-z_/]+)*"
        if lines and all(re.fullmatch(rf"{level}(?:\s*->\s*{level})+", line) for line in lines):
            for line in lines:
                chains.append([[n.strip() for n in part.split(",")] for part in line.split("->")])
    return chains


def allowed_arrows(chains, names) -> set[tuple[str, str]]:
    """(from, to) pairs the chains over `names` allow: to is at a lower level of one chain."""
    allowed = set()
    for chain in chains:
        if not all(n in names for level in chain for n in level):
            continue
        for i, upper in enumerate(chain):
            for lower in chain[i + 1 :]:
                allowed |= {(a, b) for a in upper for b in lower}
    return allowed


def module_rule():
    modules = {p.name for p in REPO.iterdir() if p.is_dir()}
    chains = [c for c in rule_chains() if all(n in modules for level in c for n in level)]
    names = {n for c in chains for level in c for n in level}
    return names, allowed_arrows(chains, names)


def wing_rule():
    tops = [p for p in ALLOCATOR_SRC.iterdir() if p.is_dir()]
    wings = {p.name for p in tops} | {f"{p.name}/{q.name}" for p in tops for q in p.iterdir() if q.is_dir()}
    chains = [c for c in rule_chains() if all(n in wings for level in c for n in level)]
    names = {n for c in chains for level in c for n in level}
    return names, allowed_arrows(chains, names)


def wing_order() -> list[str]:
    """The wings from the top, as the page's chain over them lists them (one wing per level)."""
    names, _ = wing_rule()
    chains = [c for c in rule_chains() if all(n in names for level in c for n in level)]
    assert len(chains) == 1 and all(len(level) == 1 for level in chains[0]), "one chain of wings"
    return [level[0] for level in chains[0]]


def wing_table() -> dict[str, str]:
    """The page's table of wings: public header (as included, `torpor/...`) -> wing."""
    text = PAGE.read_text(encoding="utf-8").split("## The allocator's wings", 1)[1].split("\n## ", 1)[0]
    table = {}
    for row in re.findall(r"^\| `([a-z_/]+)` \|.*\|([^|]*)\|\s*$", text, re.M):
        for header in re.findall(r"`(torpor/[^`]+)`", row[1]):
            table[header] = row[0]
    return table


# -- the code ------------------------------------------------------------------------------


def source_files(module: str):
    for p in sorted((REPO / module).rglob("*")):
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and not any(s in p.parents for s in SKIPPED):
            yield p


def includes(path: pathlib.Path) -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", path.read_text(encoding="utf-8", errors="replace"), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return INCLUDE.findall(text)


def include_module(include: str, wings: set[str]):
    if include.startswith("torpor/fusion/"):
        return "fusion"
    if include.startswith("torpor/kernels/"):
        return "kernels"
    if include.startswith("torpor/") or include.split("/")[0] in wings:
        return "allocator"
    return None  # a system header, or one of the including module's own


def file_wing(path: pathlib.Path, wing_names: set[str]):
    """The wing of a file under allocator/src/: its first folder, or its first two where the
    rule names them as a wing of their own (pool/store)."""
    parts = path.relative_to(ALLOCATOR_SRC).parts
    return "/".join(parts[:2]) if "/".join(parts[:2]) in wing_names else parts[0]


def include_wing(include: str, wing_names: set[str], header_wings: dict[str, str]):
    parts = include.split("/")
    if include.startswith("torpor/"):
        return header_wings.get(include, "")  # "" = unknown: reported by its own test
    if parts[0] in {w.split("/")[0] for w in wing_names} and len(parts) > 1:
        return "/".join(parts[:2]) if "/".join(parts[:2]) in wing_names else parts[0]
    return None


def allocator_headers() -> dict[str, pathlib.Path]:
    """Every header of the allocator's three include folders, as it is included."""
    out = {}
    for folder in ("include", "internal/include", "testing/include"):
        base = REPO / "allocator" / folder
        for p in base.rglob("*"):
            if p.is_file() and p.suffix in {".h", ".hpp", ".in"}:
                name = p.relative_to(base).as_posix()
                out[name[: -len(".in")] if name.endswith(".in") else name] = p
    return out


def header_wings(table: dict[str, str], headers: dict[str, pathlib.Path], order: list[str]) -> dict[str, str]:
    """The table's wings, and for a header the table does not name, the lowest wing (last in
    `order`) of the placed headers that include it, placed in turn."""
    placed = dict(table)
    changed = True
    while changed:
        changed = False
        for name in [n for n in headers if n in placed]:
            for inc in includes(headers[name]):
                if inc in headers and inc not in table:
                    lowest = max(placed.get(inc, placed[name]), placed[name], key=order.index)
                    if placed.get(inc) != lowest:
                        placed[inc] = lowest
                        changed = True
    return placed


def cmake_commands(path: pathlib.Path):
    """(command, arguments) of a CMake file, comments removed, arguments split as CMake does for
    unquoted words (generator expressions kept whole)."""
    text = re.sub(r"(?m)#(?!\[).*$", "", path.read_text(encoding="utf-8"))
    for m in re.finditer(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(", text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield m.group(1).lower(), re.findall(r'"[^"]*"|\S+', text[m.end() : i - 1])


def cmake_graph(modules):
    """Targets defined under each module, aliases, and the in-tree link arrows between them."""
    target_module, alias, links = {}, {}, []
    for module in modules:
        for path in sorted((REPO / module).rglob("CMakeLists.txt")) + sorted((REPO / module).rglob("*.cmake")):
            if any(s in path.parents for s in SKIPPED):
                continue
            for command, args in cmake_commands(path):
                if command in ("add_library", "add_executable") and args and "$" not in args[0]:
                    if len(args) >= 3 and args[1] == "ALIAS":
                        alias[args[0]] = args[2]
                    else:
                        target_module[args[0]] = module
                elif command == "target_link_libraries" and args and "$" not in args[0]:
                    links.append((args[0], args[1:]))
    arrows = set()
    for target, items in links:
        for item in items:
            for name in re.findall(r"[A-Za-z0-9_:]+", item):
                dep = alias.get(name, name)
                if dep in target_module and target in target_module:
                    arrows.add((target_module[target], target_module[dep], f"{target} -> {name}"))
    return target_module, arrows


# -- the checks ----------------------------------------------------------------------------


def test_the_page_states_both_rules():
    modules, allowed = module_rule()
    assert {"allocator", "kernels", "fusion", "tools"} <= modules and allowed
    wings, allowed = wing_rule()
    assert {"api", "ranks", "pool", "driver", "common"} <= wings and allowed
    for wing in wings:
        assert (ALLOCATOR_SRC / wing).is_dir(), f"the rule names a wing with no folder: {wing}"


def test_cmake_links_follow_the_modules_rule():
    modules, allowed = module_rule()
    target_module, arrows = cmake_graph(sorted(modules))
    assert set(target_module.values()) == modules, "every module of the rule defines a target"
    assert arrows, "some target links another module's"
    wrong = sorted(why for a, b, why in arrows if a != b and (a, b) not in allowed)
    assert wrong == [], f"links against the rule of docs/architecture.md: {wrong}"


def test_includes_follow_the_modules_rule():
    modules, allowed = module_rule()
    wings, _ = wing_rule()
    wrong, seen = [], 0
    for module in sorted(modules):
        for path in source_files(module):
            for inc in includes(path):
                target = include_module(inc, wings)
                if target and target != module:
                    seen += 1
                    if (module, target) not in allowed:
                        wrong.append(f"{path.relative_to(REPO)}: {inc}")
    assert seen, "some file includes another module's header"
    assert wrong == [], f"includes against the rule of docs/architecture.md: {wrong}"


def test_every_public_header_has_a_wing():
    table = wing_table()
    headers = allocator_headers()
    wings, _ = wing_rule()
    assert set(table.values()) <= wings
    assert sorted(set(table) - set(headers)) == [], "the table names headers that do not exist"
    placed = header_wings(table, headers, wing_order())
    assert sorted(set(headers) - set(placed)) == [], "headers no named header includes: name them in the table"


def test_includes_follow_the_wings_rule():
    wings, allowed = wing_rule()
    headers = allocator_headers()
    placed = header_wings(wing_table(), headers, wing_order())
    files = [(p, file_wing(p, wings)) for p in source_files("allocator/src")]
    files += [(p, placed.get(name)) for name, p in headers.items()]
    wrong, seen = [], 0
    for path, wing in files:
        for inc in includes(path):
            target = include_wing(inc, wings, placed)
            if target and wing and target != wing:
                seen += 1
                if (wing, target) not in allowed:
                    wrong.append(f"{path.relative_to(REPO)} ({wing}): {inc} ({target})")
    assert seen > 20, "the wings include each other"
    assert wrong == [], f"includes against the wings' rule of docs/architecture.md: {wrong}"


def test_only_the_driver_includes_cuda_h():
    wings, _ = wing_rule()
    offenders = [
        str(p.relative_to(REPO))
        for p in source_files("allocator")
        if "cuda.h" in includes(p) and not (ALLOCATOR_SRC / "driver") in p.parents
    ]
    assert offenders == []
    assert any("cuda.h" in includes(p) for p in source_files("allocator/src/driver")), "the driver's does"


def python_imports():
    """The package's modules and their module-level imports of each other."""
    root = REPO / "python" / "torpor"
    modules = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    edges = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for top in ast.parse(path.read_text(encoding="utf-8")).body:
            nodes = ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [top]
            for node in nodes:
                if isinstance(node, ast.Import):
                    for a in node.names:
                        target = a.name
                        while target and target not in modules:
                            target = target.rsplit(".", 1)[0] if "." in target else ""
                        if target:
                            edges[name].add(target)
                elif isinstance(node, ast.ImportFrom):
                    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                    source = ".".join(base + ([node.module] if node.module else []))
                    for a in node.names:
                        if f"{source}.{a.name}" in modules:
                            edges[name].add(f"{source}.{a.name}")
                        elif source in modules:
                            edges[name].add(source)
    return edges


def test_no_import_circle_in_the_python_package():
    edges = python_imports()
    assert len(edges) > 10 and any(edges.values())
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v] - {v}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert circles == []


@pytest.mark.parametrize(
    "chain, arrow, ok",
    [("a -> b -> c", ("a", "c"), True), ("a -> b -> c", ("c", "a"), False), ("a, b -> c", ("b", "c"), True)],
)
def test_the_rule_reading_itself(chain, arrow, ok):
    levels = [[n.strip() for n in part.split(",")] for part in chain.split("->")]
    assert (arrow in allowed_arrows([levels], {"a", "b", "c"})) is ok
