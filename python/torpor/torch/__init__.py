"""torpor.torch: the PyTorch embedding. torpor allocates the segments of torch.cuda.MemPool
pools, and the sleep API engines call, with the names and defaults of vLLM's sleep mode.

    import torpor
    with torpor.use_pool("weights"):
        model = build_model()                       # parameters, buffers: in torpor
    torpor.register_parameters(model, preserve=["embed.*"])
    with torpor.use_pool("kv_cache"):
        kv_cache = allocate_kv_cache()              # class cache: never copied
    torpor.sleep(level=2)                           # the GPU memory goes back
    ...                                             # a trainer uses it
    torpor.wake_up(["weights"]); load_weights(model); torpor.wake_up(["kv_cache"])

Every tensor keeps its address through sleep and wake, so CUDA graphs captured before sleep
replay after it. Only parameters (registered) are reloaded; buffers and anything else
allocated in a weights pool are state and come back bit-exact. PyTorch is imported lazily, so
`import torpor` works without it.

The package, each module depending only on those above it (no module imports back, none uses
another's underscore names):

- runtime: PyTorch imported lazily; device helpers.
- expandable: expandable segments off while torpor's pools allocate.
- routing: the MemPool registry (one per (tag, class, device)) and ``routed(tag, class)``, the
  one context that points a thread's allocations at torpor, which use_pool and graph capture
  share; giving empty segments back (pool lifetime and empty segments: its note).
- marks: the plan of a re-mark (which bytes of a snapshot's segments are parameters, state or
  cache), PyTorch-free.
- parameters: register_parameters and the walk over registered modules' parameter spans.
- remark: the classes of PyTorch's blocks computed from its snapshot before a sleep (``remark_now``),
  the cache that skips an unchanged one, the class policies, and the registry of state-span
  sources graphs feed.
- hook_bus: what runs around the sleeps and wakes of each device's torpor pool, installed once
  per pool: one sleep hook (torpor_add_sleep_hook) that runs the re-mark with the sleep's class
  policy, then the engine modes' tag hooks, so it runs inside every sleep of those pools,
  collective ones included; and the mapping hooks (the C pool's tag hooks).
- prepare: the host store page-locked in the background once the model is loaded, for the sleep an
  engine mode declared (TORPOR_PREPARE_SLEEP; triggered by use_pool and register_parameters).
- graphs: CUDA graphs captured into torpor graph pools (torpor.graph, torpor.graph_pool,
  torpor.mark_state).
- api: configure, use_pool (exportable pools for KV transports), sleep, wake_up, stats,
  export_handles, the host-store calls; and the engine modes' sleep with a policy,
  reconfigure, fill_on_wake, the memory margin, read_host_copy.

Engine modes (torpor.vllm, torpor.tms) use this package through torpor.engine only.

PyTorch's known pitfalls with pluggable allocators and pools, and what is done about each:

- Pool lifetime (pytorch#146431): torpor's MemPools live for the whole process (routing).
- empty_cache (pytorch#145168): torch.cuda.empty_cache() releases a private pool's cached
  segments only once the pool's use count drops to zero, never for a live pool, so free
  space stays in torpor's segments while awake. At sleep it costs nothing: every free block
  is reclassified as cache first (never copied) and its memory is released with the rest.
  When PyTorch does hand a segment back (out-of-memory retry, teardown), torpor_torch_free
  waits for the device before unmapping, since PyTorch relies on cudaFree's implicit sync.
  sleep() ends with torch.cuda.empty_cache(), as vLLM's does, so the default pool's cached
  memory goes back to the device too.
- Empty segments while awake: given back when the last use_pool() block of a MemPool exits,
  and the MemPool retired (routing).
- Expandable segments: turned off while any torpor pool is in use (expandable); sleep()
  warns about any segment of a torpor MemPool that is not torpor's.

Sleep and wake act on every device that has torpor pools. The CUDA current device is
restored after each call (the driver calls make the pool's device current).
"""

from .api import (
    configure,
    export_handles,
    pools,
    prepare_host_store,
    release_host_store,
    sleep,
    stats,
    tag_states,
    use_pool,
    wake_up,
)
from .graphs import GraphPool, graph, graph_memory, graph_pool, graph_pools, mark_state, memory_nodes
from .parameters import Registration, register_parameters

__all__ = [
    "GraphPool",
    "Registration",
    "configure",
    "export_handles",
    "graph",
    "graph_memory",
    "graph_pool",
    "graph_pools",
    "mark_state",
    "memory_nodes",
    "pools",
    "prepare_host_store",
    "register_parameters",
    "release_host_store",
    "sleep",
    "stats",
    "tag_states",
    "use_pool",
    "wake_up",
]
