"""docs/design/sleep.md holds THE class x level table; allocator/src/pool/sleep_policy.hpp decides it
in the code. This test reads the table from the page and drives a pool on the host backend
through every level it names: for every row, bytes written before the sleep must come back after
the wake where the cell says offload, and come back as the poison fill where it says discard. So
the page and the policy cannot change apart: a cell edited alone, or the policy changed alone,
fails here. The oracle is the bytes themselves (fill_on_wake="poison")."""

import re

import pytest

import torpor
from conftest import POISON, REPO, pattern

PAGE = REPO / "docs" / "design" / "sleep.md"
PRESERVE_GLOB = "embed.*"
SIZE = 64 << 10  # bytes per allocation: carved from a slab of its own tag and class


def table():
    """The table's levels (from its header) and rows: label -> [fate per level]."""
    text = PAGE.read_text(encoding="utf-8").split("## The class × level table", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[0] == "class", header
    levels = [int(re.fullmatch(r"level (\d+)", c).group(1)) for c in header[1:]]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return levels, rows


def allocation_for(label: str):
    """A row's label as (memory class, allocation name): a class name, or '<class> matching a
    preserve glob'."""
    m = re.fullmatch(r"(\w+)( matching a preserve glob)?", label)
    assert m, f"a row the test cannot read: {label!r}"
    cls = torpor.MemoryClass(m.group(1))  # raises for a class the library does not know
    return cls, ("embed.weight" if m.group(2) else "layers.0.w")


def test_the_table_names_every_class_and_only_fates():
    levels, rows = table()
    assert levels and 0 not in levels
    classes = {allocation_for(label)[0] for label in rows}
    assert classes == set(torpor.MemoryClass)
    assert {fate for fates in rows.values() for fate in fates} <= {"offload", "discard"}
    assert all(len(fates) == len(levels) for fates in rows.values())


def test_the_table_has_a_column_for_every_level_the_pool_takes(pool):
    levels, _ = table()
    pool.alloc(SIZE, "w")
    for level in levels:
        pool.sleep(level)
        pool.wake_up()
    with pytest.raises(torpor.InvalidArgument):
        pool.sleep(max(levels) + 1)


@pytest.mark.parametrize("column", range(len(table()[0])))
def test_every_cell_is_what_a_sleep_does(pool, column):
    levels, rows = table()
    pool.set_preserve([PRESERVE_GLOB])
    placed = {}
    for i, label in enumerate(rows):
        cls, name = allocation_for(label)
        ptr = pool.alloc(SIZE, f"tag{i}", cls.name.lower(), name)
        pool.write(ptr, pattern(SIZE, i + 1))
        placed[label] = (ptr, pattern(SIZE, i + 1))
    pool.sleep(levels[column])
    pool.wake_up()
    came_back = {}
    for label, (ptr, written) in placed.items():
        data = pool.read(ptr, SIZE)
        came_back[label] = "offload" if data == written else "discard" if data == POISON * SIZE else "garbled"
    assert came_back == {label: fates[column] for label, fates in rows.items()}


def test_level_0_does_nothing(pool):
    ptrs = [pool.alloc(SIZE, f"t{c.name}", c.name.lower()) for c in torpor.MemoryClass]
    for i, p in enumerate(ptrs):
        pool.write(p, pattern(SIZE, i))
    pool.sleep(0)
    assert not any(t["asleep"] for t in pool.stats()["tags"].values())
    assert [pool.read(p, SIZE) for p in ptrs] == [pattern(SIZE, i) for i in range(len(ptrs))]
