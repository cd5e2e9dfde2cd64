"""Which bytes of PyTorch's segments are parameters, state or cache, right before a sleep.

torpor only sees segments; PyTorch's caching allocator carves tensors out of them and reuses
freed blocks for anything. A class set once at load time goes stale: a freed block keeps
its old class (a dead parameter's range reused for a buffer would be discarded at level 2),
and free space would be copied as state. So before every sleep the embedding recomputes the
classes of every segment of the sleeping tags from PyTorch's own view (MemPool.snapshot()):

- a free block ("inactive") is cache: it holds nothing, never travels;
- an allocated block takes its tag's class (state, or cache for a KV-cache tag);
- then every live tensor declared state (torpor.mark_state) keeps its exact span as state,
  whatever its block's class (an output of a graph pool, which is class cache);
- then every live registered parameter's exact byte span is a parameter, with its
  qualified name, so preserve globs match.

This module is the plan only (torch-free, so CI tests it without PyTorch); torpor.torch.remark
feeds it snapshots and named parameters and applies the marks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from ..pool import MemoryClass


# Tuples rather than dataclasses: a sleep makes one per block and per parameter (thousands), and
# compares the spans with the last sleep's as a whole (torpor.torch.remark keeps the last plan).
class Mark(NamedTuple):
    address: int
    nbytes: int
    memory_class: MemoryClass
    name: str | None = None


class Span(NamedTuple):
    """A named byte range (a parameter's storage span)."""

    name: str
    address: int
    nbytes: int


@dataclass
class Plan:
    marks: list[Mark]
    foreign: list[int]  # segment addresses that cannot be torpor's (expandable segments)
    parameters: int = 0  # parameter spans marked
    parameter_bytes: int = 0
    states: int = 0  # declared state spans marked


def segment_blocks(segment: dict) -> Iterable[tuple[int, int, str]]:
    """(address, size, state) of a snapshot segment's blocks, in address order. Blocks carry
    their address in recent PyTorch; older versions list them in order from the segment start."""
    at = segment["address"]
    for block in segment.get("blocks", []):
        address = block.get("address", at)
        yield address, block["size"], block["state"]
        at = address + block["size"]


def plan(
    segments: Iterable[dict], default_class: MemoryClass, parameters: Iterable[Span], states: Iterable[Span] = ()
) -> Plan:
    """The marks that make a pool's classes match `segments` (one MemPool's snapshot, one
    device), for a tag whose allocated bytes are `default_class`; `states` are spans declared
    state, `parameters` registered parameters (spans outside the segments are ignored)."""
    marks: list[Mark] = []
    foreign: list[int] = []
    ranges: list[tuple[int, int]] = []
    for seg in segments:
        if seg.get("is_expandable"):
            foreign.append(seg["address"])
            continue
        ranges.append((seg["address"], seg["address"] + seg["total_size"]))
        for address, size, state in segment_blocks(seg):
            if size == 0:
                continue
            cls = MemoryClass.CACHE if state == "inactive" else default_class
            marks.append(Mark(address, size, cls))
    result = Plan(marks, foreign)
    ranges.sort()
    starts = [lo for lo, _ in ranges]

    def inside(span: Span) -> bool:
        i = bisect.bisect_right(starts, span.address) - 1
        return span.nbytes > 0 and i >= 0 and span.address + span.nbytes <= ranges[i][1]

    for s in states:
        if inside(s):
            marks.append(Mark(s.address, s.nbytes, MemoryClass.STATE, s.name))
            result.states += 1
    for p in parameters:
        if inside(p):
            marks.append(Mark(p.address, p.nbytes, MemoryClass.PARAMETER, p.name))
            result.parameters += 1
            result.parameter_bytes += p.nbytes
    return result


def apply(pool, p: Plan) -> None:
    """Make the marks of a plan in a torpor.Pool, in one C call (blocks, then states, then
    parameters: later wins)."""
    pool.mark_ranges((m.address, m.nbytes, m.memory_class, m.name) for m in p.marks)
