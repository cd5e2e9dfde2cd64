"""torpor.Pool at its edges (issue 19): sizes that would wrap in a C size_t, tags and globs the C
API cannot carry, and one string given where a list of globs is expected. Each is refused with
InvalidArgument naming what is accepted, and the pool stays usable."""

import pytest

import torpor
from conftest import MiB, POISON, pattern


@pytest.mark.parametrize("nbytes", [2**64 + 5, 2**64, -1, 0, 1.5, True])
def test_alloc_refuses_sizes_a_size_t_cannot_hold(pool, nbytes):
    with pytest.raises(torpor.InvalidArgument):
        pool.alloc(nbytes)
    assert pool.stats()["tags"] == {}, "nothing was allocated"


def test_mark_and_copy_refuse_wrapping_sizes(pool):
    p = pool.alloc(MiB, "weights", "state", "w")
    with pytest.raises(torpor.InvalidArgument, match="out of range"):
        pool.mark(p, 2**64 + 8, "parameter")
    assert pool.stats()["tags"]["weights"]["classes"]["parameter"]["allocated_bytes"] == 0
    with pytest.raises(torpor.InvalidArgument):
        pool.copy(p, p, -1)  # was a SIGSEGV: -1 became SIZE_MAX
    with pytest.raises(torpor.InvalidArgument, match="wraps"):
        pool.copy(p, p, 2**64 - 1)
    pool.write(p, pattern(4096))
    assert pool.read(p, 4096) == pattern(4096)


@pytest.mark.parametrize("tag", ["w\ud800", "w\0x", "", None])
def test_tags_the_c_api_cannot_carry_are_refused(pool, tag):
    with pytest.raises(torpor.InvalidArgument):
        pool.alloc(4096, tag)
    with pytest.raises(torpor.InvalidArgument):
        pool.sleep(1, [tag])
    pool.alloc(4096, "weights")
    pool.sleep(1)
    pool.wake_up()
    assert list(pool.stats()["tags"]) == ["weights"]


def test_set_preserve_with_one_string_is_one_glob(pool):
    embed = pool.alloc(MiB, "weights", "parameter", "embed.weight")
    layer = pool.alloc(MiB, "weights", "parameter", "layers.0.w")
    pool.write(embed, pattern(MiB, 1))
    pool.write(layer, pattern(MiB, 2))
    pool.set_preserve("embed.*")  # not the globs 'e', 'm', ..., '*'
    pool.sleep(2)
    pool.wake_up()
    assert pool.read(embed, MiB) == pattern(MiB, 1)
    assert pool.read(layer, MiB) == POISON * MiB, "'*' was not taken as a glob of its own"


@pytest.mark.parametrize("globs", [[None], ["a\0b"], ["x\udc80"], [""]])
def test_set_preserve_refuses_globs_that_are_not_text(pool, globs):
    with pytest.raises(torpor.InvalidArgument):
        pool.set_preserve(globs)


@pytest.mark.parametrize("level", [3, -1, 2**40, 1.0])
def test_sleep_levels_outside_0_to_2_are_refused(pool, level):
    pool.alloc(4096)
    with pytest.raises(torpor.InvalidArgument, match="0 to 2"):
        pool.sleep(level)
    assert pool.stats()["tags"]["default"]["asleep"] is False
