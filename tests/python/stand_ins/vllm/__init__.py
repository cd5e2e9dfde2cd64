"""A stand-in for vLLM (see ../README.md): the call sites torpor's plugin meets, nothing else.

STAND_IN_VLLM_GENERATION picks the generation the package reproduces (README's table):
"v0" (the oldest: no sleep-mode backends, the worker imports CuMemAllocator at module load),
"v1" (the V1 worker with the first sleep-mode backend contract, the default), "mrv2" (Model
Runner V2: the newest backend contract, tag hooks, the graph pool, weight transfer).
STAND_IN_VLLM_NO_BACKENDS=1 is the older spelling of "v0"."""

import os

GENERATIONS = ("v0", "v1", "mrv2")
GENERATION = (
    "v0" if os.environ.get("STAND_IN_VLLM_NO_BACKENDS") == "1" else os.environ.get("STAND_IN_VLLM_GENERATION", "v1")
)
if GENERATION not in GENERATIONS:
    raise ImportError(f"STAND_IN_VLLM_GENERATION={GENERATION!r}: expected one of {', '.join(GENERATIONS)}")
