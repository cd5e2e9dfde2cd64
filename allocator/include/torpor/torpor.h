/* torpor C API: sleep-mode-aware GPU memory pools, for embedding from C, Python (ctypes) or
 * any engine. No C++ exception crosses this boundary: every function returns a status and,
 * on failure, torpor_last_error() returns the message (thread-local, valid until the next
 * call on the same thread).
 *
 *   torpor_pool_options o; torpor_pool_options_init(&o);
 *   torpor_pool_t pool; torpor_pool_create(&o, &pool);
 *   void* w; torpor_alloc(pool, 1 << 20, TORPOR_TAG_WEIGHTS, TORPOR_CLASS_PARAMETER, "layer0.w", &w);
 *   const char* tags[] = {TORPOR_TAG_WEIGHTS};
 *   torpor_sleep(pool, 2, NULL, 0);      // all tags
 *   torpor_wake_up(pool, tags, 1);       // weights only
 *   torpor_pool_destroy(pool);
 */
#ifndef TORPOR_TORPOR_H
#define TORPOR_TORPOR_H

#include <stddef.h> /* NOLINT(modernize-deprecated-headers): a C header */

#include "torpor/backend.h"
#include "torpor/status.h"
#include "torpor/version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct torpor_pool_s* torpor_pool_t;

/* The tags torpor's clients share by convention (torpor/tags.hpp says what each holds). To the
 * pool a tag is any non-empty string. */
#define TORPOR_TAG_WEIGHTS "weights"
#define TORPOR_TAG_KV_CACHE "kv_cache"
#define TORPOR_TAG_CUDA_GRAPH "cuda_graph"

typedef enum torpor_class {
  TORPOR_CLASS_PARAMETER = 0, /* reloadable weights: offloaded at level 1, discarded at level 2 */
  TORPOR_CLASS_STATE = 1,     /* must survive bit-exact: always offloaded */
  TORPOR_CLASS_CACHE = 2      /* recomputable: always discarded */
} torpor_class;

typedef enum torpor_fill { TORPOR_FILL_NONE = 0, TORPOR_FILL_ZERO = 1, TORPOR_FILL_POISON = 2 } torpor_fill;

/* The `level` of torpor_sleep and its kin (what each does to each class: README's sleep table). */
typedef enum torpor_sleep_level {
  TORPOR_SLEEP_NONE = 0,              /* memory is not touched */
  TORPOR_SLEEP_OFFLOAD = 1,           /* parameters and state offloaded, cache discarded */
  TORPOR_SLEEP_DISCARD_PARAMETERS = 2 /* parameters discarded too, unless preserved; state offloaded */
} torpor_sleep_level;

typedef struct torpor_pool_options {
  int device;       /* default 0 */
  int backend;      /* torpor_backend; default AUTO (TORPOR_BACKEND, else cuda if usable, else host) */
  size_t va_bytes;  /* 0 = twice the device's memory */
  int fill_on_wake; /* torpor_fill; default NONE */
  int exportable;   /* 1: memory with shareable handles (POSIX fds; fabric handles where the device can) and
                       GPUDirect RDMA capable where the device can: symmetric memory, torpor_export_handles;
                       default 0 */
  /* Host memory (PoolOptions in torpor/pool.hpp says more). Default: host copies kept after wake,
   * no limit, no disk tier. */
  int skip_unchanged;            /* 1: keep host copies after wake, so an unchanged re-sleep copies nothing
                                    (costs host memory while awake); 0: give them back at wake. Default 1 */
  size_t host_store_limit;       /* page-locked host bytes at most; beyond: pageable memory, or spill_dir; 0 = none */
  size_t host_store_prepare;     /* start page-locking this many bytes in the background at creation; default 0 */
  const char* spill_dir;         /* beyond host_store_limit, backups go to a file here (needs a limit; the
                                    string is copied); NULL = no disk tier */
  size_t spill_limit;            /* disk bytes at most; 0 = what the disk holds */
  int spill_file_per_allocation; /* 1: a file of its own in spill_dir per backed-up range of an allocation
                                    (torch_memory_saver's layout; needs spill_dir); 0 (default): one file */
} torpor_pool_options;

void torpor_pool_options_init(torpor_pool_options* options);

torpor_status torpor_pool_create(const torpor_pool_options* options, torpor_pool_t* out);
/* The pool's memory goes back. TORPOR_ERROR_INVALID_STATE for the pool behind PyTorch's allocator
   (torpor_torch_pool): PyTorch holds segments in it, so it lives until the process exits. */
torpor_status torpor_pool_destroy(torpor_pool_t pool);

/* tag NULL = "default"; name may be NULL. */
torpor_status torpor_alloc(torpor_pool_t pool, size_t bytes, const char* tag, int memory_class, const char* name,
                           void** out);
torpor_status torpor_free(torpor_pool_t pool, void* ptr);
/* Reclassify [ptr, ptr + bytes) inside one allocation; name NULL or "" keeps the name. */
torpor_status torpor_mark(torpor_pool_t pool, void* ptr, size_t bytes, int memory_class, const char* name);
/* Parameters matching one of the globs are offloaded (not discarded) by level 2. */
torpor_status torpor_set_preserve(torpor_pool_t pool, const char* const* globs, size_t count);

/* Reclassify `count` ranges [ptrs[i], ptrs[i] + bytes[i]) as memory_classes[i], named names[i], in
 * one call and in order (a later range wins where ranges overlap): what an embedding does before
 * every sleep. Every range is checked first; on a bad one nothing changes and the message names its
 * index. names NULL, or names[i] NULL or "", keeps the names. count is at most
 * TORPOR_MAX_MARK_RANGES per call (TORPOR_ERROR_INVALID_ARGUMENT beyond, nothing read). */
#define TORPOR_MAX_MARK_RANGES ((size_t)1 << 24)
torpor_status torpor_mark_ranges(torpor_pool_t pool, size_t count, void* const* ptrs, const size_t* bytes,
                                 const int* memory_classes, const char* const* names);

/* The fill of discarded bytes for the wakes from now on (torpor_fill; the pool option
 * fill_on_wake), for engines that decide it per wake; *previous (may be NULL) gets the old one. */
torpor_status torpor_set_fill_on_wake(torpor_pool_t pool, int fill, int* previous);

/* tags NULL / count 0 = all known tags. */
torpor_status torpor_sleep(torpor_pool_t pool, int level, const char* const* tags, size_t count);
torpor_status torpor_wake_up(torpor_pool_t pool, const char* const* tags, size_t count);

/* Sleep hooks: callbacks a layer above the pool runs inside its sleep and wake (torpor::SleepObserver
 * in C). Called on the thread that sleeps or wakes, outside the pool's lock (a hook may mark, read
 * stats, ...; it must not sleep or wake this pool), for levels 1 and 2 only, with the resolved tag
 * list (every tag the call acts on). Either callback may be NULL, not both.
 *   before_sleep(user, pool, level, tags, count, message, capacity): runs before anything moves.
 *     TORPOR_OK lets the sleep go on; any other status aborts it with nothing changed in the pool,
 *     and the sleep returns that status (TORPOR_ERROR_INVALID_ARGUMENT, _INVALID_STATE,
 *     _OUT_OF_MEMORY, _TIMEOUT or _UNAVAILABLE; any other as TORPOR_ERROR_INTERNAL) with the
 *     NUL-terminated text the hook wrote into message[0, capacity) in its torpor_last_error().
 *     A collective sleep names that rank's failure the same way, and every rank rolls back.
 *   after_wake(user, pool, tags, count, ok): after every wake of those tags; ok is 0 when it failed.
 * The hooks run in the order they were added. *id identifies the hook for torpor_remove_sleep_hook;
 * once that returns, no new call of the hook starts (one already running on another thread ends
 * normally). user must stay valid until then. */
typedef torpor_status (*torpor_before_sleep_hook)(void* user, torpor_pool_t pool, int level, const char* const* tags,
                                                  size_t count, char* message, size_t capacity);
typedef void (*torpor_after_wake_hook)(void* user, torpor_pool_t pool, const char* const* tags, size_t count, int ok);
torpor_status torpor_add_sleep_hook(torpor_pool_t pool, torpor_before_sleep_hook before_sleep,
                                    torpor_after_wake_hook after_wake, void* user, unsigned long long* id);
/* TORPOR_ERROR_INVALID_ARGUMENT for an id that is not a hook of this pool (removed twice?). */
torpor_status torpor_remove_sleep_hook(torpor_pool_t pool, unsigned long long id);

/* Tag hooks (torpor::TagHooks in C; vLLM's register_tag_hooks maps onto them): callbacks for state
 * that must live exactly as long as a tag's mapping, such as a transport's registration of the KV
 * cache. Called on the thread that sleeps or wakes, outside the pool's lock (a hook must not sleep
 * or wake this pool). Either callback may be NULL, not both; tag is copied.
 *   before_unmap(user, pool, tag, message, capacity): in every sleep (levels 1, 2; a discard is a
 *     level-2 sleep) of `tag` while some of its memory is mapped, before anything moves and before
 *     the sleep hooks above. TORPOR_OK lets the sleep go on; any other status aborts it with
 *     nothing moved, as a sleep hook's refusal does (same statuses, message into message[0,
 *     capacity)).
 *   after_map(user, pool, tag): after every torpor_wake_up, once, when `tag` is fully mapped (no
 *     byte asleep; a tag the pool does not know yet counts), after the sleep hooks' after_wake.
 *     It must be idempotent: it also runs for a tag that never slept.
 * A sleep that fails after before_unmap ran calls after_map for each such tag it left fully mapped
 * (nothing stays torn down over mapped memory); a tag left partly asleep gets it from the wake that
 * maps it. Hooks run in the order added. After torpor_remove_tag_hooks returns no new call starts;
 * user must stay valid until then. An id that is not a live tag hook is
 * TORPOR_ERROR_INVALID_ARGUMENT. */
typedef torpor_status (*torpor_before_unmap_hook)(void* user, torpor_pool_t pool, const char* tag, char* message,
                                                  size_t capacity);
typedef void (*torpor_after_map_hook)(void* user, torpor_pool_t pool, const char* tag);
torpor_status torpor_add_tag_hooks(torpor_pool_t pool, const char* tag, torpor_before_unmap_hook before_unmap,
                                   torpor_after_map_hook after_map, void* user, unsigned long long* id);
torpor_status torpor_remove_tag_hooks(torpor_pool_t pool, unsigned long long id);
/* after_map of every hooked tag that is fully mapped, as at the end of torpor_wake_up: for a
 * caller whose wake selects nothing to map (vLLM runs its after_map hooks after every wake-up).
 * An after_map hook that throws (C++ callers) fails the call after the others ran. */
torpor_status torpor_run_after_map_hooks(torpor_pool_t pool);

/* Host memory. torpor_release_host_store drops the host copies kept after wake (skip_unchanged)
 * and gives every unused block of the host store back, memory and disk; *released (may be NULL)
 * gets the bytes released. torpor_prepare_host_store starts page-locking host memory in the
 * background until the pinned store holds `bytes` (0 = what a level-1 sleep of everything
 * allocated now needs), so that the first sleep copies at full speed: call it while the model
 * loads; wait != 0 blocks until the pinning is done; *added (may be NULL) gets the bytes added.
 * More bytes than the machine's memory is TORPOR_ERROR_INVALID_ARGUMENT, with nothing done.
 * Host bytes (held, page-locked, being pinned, used, retained, on disk) are in the stats JSON. */
torpor_status torpor_release_host_store(torpor_pool_t pool, size_t* released);
torpor_status torpor_prepare_host_store(torpor_pool_t pool, size_t bytes, int wait, size_t* added);
/* The host store bytes a sleep at `level` of `tags` (NULL/0: all) would hold with the classes
 * marked now (0 for level 0): what to pass torpor_prepare_host_store before a first sleep. */
torpor_status torpor_sleep_host_bytes(torpor_pool_t pool, int level, const char* const* tags, size_t count,
                                      size_t* bytes);

/* JSON documents. Writes at most `capacity` bytes (NUL included) to `buffer` and the full
 * size needed (NUL included) to *needed; call again with a larger buffer if it did not fit. */
torpor_status torpor_stats_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed);
/* The report of the pool's last sleep or wake_up. */
torpor_status torpor_last_report_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed);
/* The pool's tags, sorted, as a JSON array of strings: the stats document's tag names, without
 * computing the statistics (an embedding asks for them at every sleep and wake). */
torpor_status torpor_tags_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed);
/* "cuda" or "host". */
const char* torpor_pool_backend(torpor_pool_t pool);

/* Base address and size of the allocation containing ptr; TORPOR_ERROR_INVALID_ARGUMENT if none. */
torpor_status torpor_find(torpor_pool_t pool, const void* ptr, void** base, size_t* bytes);

/* Shareable handles of an exportable pool's memory (torpor_pool_options.exportable = 1), one per chunk
 * (one physical handle mapped at a fixed span), for a KV transport that registers the memory with a NIC
 * or hands it to another process (torpor::Pool::export_handles in C++, Pool.export_handles in Python). */
typedef enum torpor_handle_kind {
  TORPOR_HANDLE_AUTO = 0,     /* fabric where the pool's memory has fabric handles, else a POSIX descriptor */
  TORPOR_HANDLE_POSIX_FD = 1, /* a POSIX file descriptor: to a process of this node (SCM_RIGHTS) */
  TORPOR_HANDLE_FABRIC = 2    /* 64 bytes (CUmemFabricHandle): over any transport, to any node of the NVLink
                                 domain (through the IMEX service) */
} torpor_handle_kind;
#define TORPOR_FABRIC_HANDLE_BYTES 64
#define TORPOR_EXPORT_TAG_MAX 255 /* the longest tag an export entry carries, in bytes */
typedef struct torpor_chunk_export {
  void* va;                                         /* the chunk's start; the same address across sleep and wake */
  size_t bytes;                                     /* the chunk's size: the handle maps [va, va + bytes) */
  int kind;                                         /* TORPOR_HANDLE_POSIX_FD or TORPOR_HANDLE_FABRIC */
  int fd;                                           /* POSIX_FD: a new descriptor the caller owns and must close;
                                                       -1 for a fabric handle */
  unsigned char fabric[TORPOR_FABRIC_HANDLE_BYTES]; /* FABRIC: the handle; zeros for a descriptor */
  int gpu_direct_rdma;                              /* 1: created GPUDirect RDMA capable (a NIC may register it) */
  char tag[TORPOR_EXPORT_TAG_MAX + 1];              /* the tag of the chunk's allocations, NUL-terminated */
} torpor_chunk_export;
/* The handles of the chunks holding allocations of `tags` (NULL / count 0 = every tag), in address
 * order, as `kind` (torpor_handle_kind). out NULL with capacity 0 asks: *exported gets how many chunks
 * an export would give now, after every check, and nothing is exported. Else at most `capacity` entries
 * are written to out and *exported gets their number. All or nothing: on any failure nothing is handed
 * out and no descriptor stays open.
 *   TORPOR_ERROR_INVALID_STATE: the pool is not exportable, or a chunk of those tags is asleep (a sleep
 *     released its memory, so it has no handle: wake the tag first);
 *   TORPOR_ERROR_INVALID_ARGUMENT: an unknown tag, a kind outside the enum, a tag longer than
 *     TORPOR_EXPORT_TAG_MAX, out NULL with capacity > 0, or more chunks than `capacity` (then
 *     *exported gets how many there are: call again with room for them);
 *   TORPOR_ERROR_UNAVAILABLE: fabric handles where the device has none (the message says why, e.g. no
 *     IMEX channel), or a kind the backend lacks.
 * Each handle names the memory mapped now: the tag's next sleep releases it, and its wake maps new
 * memory (new handles) at the same addresses. A transport therefore drops its registration and closes
 * its descriptors in a before_unmap tag hook (an open descriptor may keep released memory alive), and
 * exports again in an after_map tag hook (torpor_add_tag_hooks). */
torpor_status torpor_export_handles(torpor_pool_t pool, const char* const* tags, size_t count, int kind,
                                    torpor_chunk_export* out, size_t capacity, size_t* exported);
/* *exportable = 1 when the pool was created exportable, else 0. */
torpor_status torpor_pool_exportable(torpor_pool_t pool, int* exportable);

/* Copies between host memory and pool memory (through the pool's driver; any direction). */
torpor_status torpor_copy(torpor_pool_t pool, void* dst, const void* src, size_t bytes);

/* The host copy that a sleep kept of [ptr, ptr + bytes), copied to the host memory at dst: the
 * backup while the allocation sleeps, the retained copy (the bytes of the last sleep) while it is
 * awake. The range must lie inside one allocation (TORPOR_ERROR_INVALID_ARGUMENT otherwise).
 * TORPOR_ERROR_INVALID_STATE, with nothing copied, when no host copy covers every byte (the bytes
 * were discarded, or no copy was retained). *asleep (when not NULL) says whether the allocation
 * sleeps, whatever the status, once the range was found. */
torpor_status torpor_read_host_copy(torpor_pool_t pool, const void* ptr, size_t bytes, void* dst, int* asleep);

/* Groups: collective sleep over the embedder's own process group (torch.distributed, an engine's
 * communicator), so no second rendezvous is needed (torpor/callback_group.hpp, collective_sleep.hpp).
 * The embedder supplies two collectives, called on the thread that called torpor:
 *   all_gather(user, mine, bytes, out): every rank contributes `mine`; the callback calls
 *     torpor_gather_append(out, ...) once per rank, in rank order (exactly `size` times), and
 *     returns 0; on failure it returns non-zero (and may say why with torpor_gather_fail).
 *   barrier(user): returns 0, or non-zero on failure.
 * File descriptors (symmetric memory) travel through a Unix group that the first such exchange
 * bootstraps over all_gather: one node only. */
typedef struct torpor_group_s* torpor_group_t;
typedef struct torpor_gather_s* torpor_gather_t;
typedef struct torpor_group_callbacks {
  int (*all_gather)(void* user, const void* mine, size_t bytes, torpor_gather_t out);
  int (*barrier)(void* user);
  void* user; /* handed to both callbacks; must outlive the group */
} torpor_group_callbacks;

/* rank in [0, size), size in [1, 65536], timeout_ms in [0, 86400000] (0 = TORPOR_GROUP_TIMEOUT_MS
 * or 60 s; it bounds the fd group's waits, the embedder's group bounds its own). */
torpor_status torpor_group_create_callbacks(int rank, int size, const torpor_group_callbacks* callbacks, int timeout_ms,
                                            torpor_group_t* out);
torpor_status torpor_group_destroy(torpor_group_t group);
torpor_status torpor_gather_append(torpor_gather_t out, const void* data, size_t bytes);
void torpor_gather_fail(torpor_gather_t out, const char* message);
/* Collective (every rank of the group, same arguments): see torpor/collective_sleep.hpp. A request
 * that differs between ranks is TORPOR_ERROR_INVALID_ARGUMENT on every rank and nothing sleeps; a
 * rank that fails to sleep fails every rank, with every rank woken back up; a failed wake leaves
 * the ranks that woke awake. The last report (torpor_last_report_json) is this rank's. */
torpor_status torpor_collective_sleep(torpor_pool_t pool, torpor_group_t group, int level, const char* const* tags,
                                      size_t count);
torpor_status torpor_collective_wake_up(torpor_pool_t pool, torpor_group_t group, const char* const* tags,
                                        size_t count);

/* The library's version, "MAJOR.MINOR.PATCH" (TORPOR_VERSION of the torpor/version.h it was built with). */
const char* torpor_version(void);

const char* torpor_last_error(void);
/* "TORPOR_ERROR_TIMEOUT" for TORPOR_ERROR_TIMEOUT, ...; "TORPOR_ERROR_UNKNOWN" for any other value. */
const char* torpor_status_name(torpor_status status);

/* The enumerations above as the library defines them, so that a binding (the Python package)
 * takes the values from the library instead of copying them:
 *   torpor_status_value: the value of the status named `name` as written in this header
 *     ("TORPOR_ERROR_TIMEOUT"); -1 for NULL or a name this library does not define;
 *   torpor_class_name, torpor_backend_name, torpor_fill_name, torpor_handle_kind_name: the
 *     lower-case name of a class ("parameter", "state", "cache"), backend ("auto", "host",
 *     "cuda"), fill ("none", "zero", "poison") or handle kind ("auto", "posix_fd", "fabric"), the
 *     names torpor's messages and tools use; NULL for a value out of range, so counting up from 0
 *     until NULL enumerates them. */
int torpor_status_value(const char* name);
const char* torpor_class_name(int memory_class);
const char* torpor_backend_name(int backend);
const char* torpor_fill_name(int fill);
/* "auto", "posix_fd" or "fabric" for a torpor_handle_kind; NULL for a value out of range. */
const char* torpor_handle_kind_name(int kind);
/* "none", "offload" or "discard_parameters" for a torpor_sleep_level; NULL for a value out of range. */
const char* torpor_sleep_level_name(int level);

/* CUDA graphs the application captured outside torpor (the cuda backend; TORPOR_ERROR_UNAVAILABLE
 * without a usable GPU):
 *   torpor_graph_memory_nodes: the memory nodes (allocation and free nodes, child graphs included)
 *     of the captured graph `graph` (a CUgraph / cudaGraph_t, as an integer) into *count: a graph
 *     with such nodes keeps memory in CUDA's graph allocator, which no sleep gives back;
 *   torpor_graph_memory: the bytes CUDA's graph allocator holds on `device` now (every graph of the
 *     process), used and reserved. */
torpor_status torpor_graph_memory_nodes(unsigned long long graph, size_t* count);
torpor_status torpor_graph_memory(int device, unsigned long long* used, unsigned long long* reserved);

#ifdef __cplusplus
}
#endif

#endif /* TORPOR_TORPOR_H */
