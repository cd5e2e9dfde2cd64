"""The host store prepared before the first sleep, where sleep is intended.

Why: a first sleep that finds no page-locked host store pins it then, and page-locking runs far
slower than the copies (a first sleep several times the steady one; issue 30). Pinned in the
background while the engine goes on after loading its model, the first sleep copies at the
steady speed.

How: an engine mode says what its sleep will do (``intend``): a plan ``steps(level, tags)`` giving, for
a sleep at that level of a device pool holding `tags`, the torpor sleeps it makes as (level, tags,
class policy). Once the model is loaded, ``after_load`` re-marks each step's tags with its policy on
every device (what the sleep's hook does first: torpor.torch.remark.remark_now), asks each device
pool for the host bytes those steps would hold (Pool.sleep_host_bytes) and starts page-locking
that much in the background (Pool.prepare_host_store, which stays within the pool's page-locked
budget). "Loaded" is the exit of the outermost use_pool block of a tag (vLLM loads its weights
in one, torch_memory_saver's users in a region) and the end of register_parameters (which makes
parameters discardable: a level-2 plan then needs only the state bytes). Each call pins only what
the store lacks, so the later ones add the difference.

A sleep that races the preparation is safe in libtorpor: prepare and sleep take the pool's lock,
a sleep's copies go first into the blocks being pinned and wait for their pinning, and a prepare
counts the blocks a sleep added; nothing is pinned twice (test_host_store.cpp's racing test).
A preparation that fails (host memory) logs a warning and never fails the load: the sleep then
grows the store itself, as without it.

TORPOR_PREPARE_SLEEP (torpor.environment) chooses: ``auto`` (default): an engine mode prepares
for its own default level (vLLM's LLM.sleep() default, level 1; torch_memory_saver's pause),
torpor.use_pool alone prepares nothing; ``1`` or ``2``: prepare for a sleep of that level, in
every mode and for torpor.use_pool too (``2`` is the RL pattern: only state bytes travel);
``off``: never prepare.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .. import environment
from ..errors import InvalidArgument, TorporError
from ..pool import Pool
from ..values import SleepLevel
from . import parameters, remark, routing

logger = logging.getLogger(__name__)

ENV = "TORPOR_PREPARE_SLEEP"
# One step of a planned sleep: (level, tags, class policy); a plan gives them for (level, the tags
# of a device pool).
Step = tuple[int, "list[str]", remark.ClassPolicy]
Plan = Callable[[int, "list[str]"], "list[Step]"]

_lock = threading.Lock()
_intent: dict = {}  # "plan": the engine mode's Plan, "level": its default level, "mode": its name


def _releasing_levels() -> list[int]:
    """The library's sleep levels that release memory (every one but none): those a host store is
    prepared for."""
    return [int(level) for level in SleepLevel if level != SleepLevel.NONE]


def _either(levels: list[int]) -> str:
    """ "1 or 2" """
    return f"{', '.join(map(str, levels[:-1]))} or {levels[-1]}" if len(levels) > 1 else str(levels[0])


def setting() -> int | None:
    """TORPOR_PREPARE_SLEEP: 0 = off, a level that releases memory = that level, None = auto
    (InvalidArgument otherwise)."""
    value = environment.text(ENV).strip().lower()
    if value == "auto":
        return None
    if value in ("off", "0", "no", "false"):
        return 0
    levels = _releasing_levels()
    if value in map(str, levels):
        return int(value)
    raise InvalidArgument(
        f"{ENV}={value!r} is not auto, off, {_either(levels)} (the sleep level to prepare the host store for)"
    )


def intend(mode: str, plan: Plan, default_level: int) -> None:
    """An engine mode's sleep plan (see the module note); the last mode to call it wins."""
    levels = _releasing_levels()
    if default_level not in levels:
        raise InvalidArgument(f"intend: default_level {default_level!r} is not {_either(levels)}")
    with _lock:
        _intent.update(mode=mode, plan=plan, level=default_level)


def forget() -> None:
    """No engine mode intends a sleep any more (tests; a mode torn down)."""
    with _lock:
        _intent.clear()


def every_tag(level: int, tags: list[str]) -> list[Step]:
    """The plan of torpor.sleep(level): every tag, each MemPool's class."""
    return [(level, list(tags), remark.pool_class)]


def planned() -> tuple[int, Plan] | None:
    """(level, plan) to prepare for now, by TORPOR_PREPARE_SLEEP and the intent; None for none."""
    level = setting()
    with _lock:
        plan, default = _intent.get("plan"), _intent.get("level")
    if level == 0 or (level is None and plan is None):
        return None
    return (default if level is None else level), (plan or every_tag)


def prepare(level: int, plan: Plan) -> dict[int, int]:
    """Re-mark and start pinning, on every device, what `plan` at `level` would hold.
    {device: bytes added}."""
    added = {}
    for device in routing.devices():
        pool = Pool.torch(device)
        known = pool.tags()
        need = 0
        for step_level, tags, policy in plan(level, known):
            tags = [t for t in tags if t in known]
            if not tags:
                continue
            remark.remark_now(device, tags, policy)
            need += pool.sleep_host_bytes(step_level, tags)
        added[device] = pool.prepare_host_store(need) if need > 0 else 0
    return added


def after_load(*_args) -> dict[int, int]:
    """The trigger: prepare for the planned sleep, never raising (see the module note)."""
    try:
        chosen = planned()
        if chosen is None:
            return {}
        added = prepare(*chosen)
    except TorporError as e:
        logger.warning(
            "torpor: preparing the host store for the first sleep failed (%s); that sleep pins it",
            e,
        )
        return {}
    if any(added.values()):
        logger.info(
            "torpor: page-locking %s bytes of host store in the background for the first sleep",
            added,
        )
    return added


parameters.on_registered(after_load)
