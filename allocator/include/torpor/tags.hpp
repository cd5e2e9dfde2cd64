// The pool tags torpor's clients share by convention (the names of vLLM's sleep mode), named once
// so that engines, torpor's own model, tools and benches, and the Python package (torpor.tags)
// spell them alike. To the pool a tag is any non-empty string; these names carry no special
// meaning inside it: what sleep does with the bytes follows their class, not their tag.
// C users: TORPOR_TAG_* in torpor/torpor.h (the same strings).
#pragma once

namespace torpor::tags {

// Parameters and everything computed at load (buffers, expert tables, the tail's state): woken
// first, then the parameters are reloaded.
inline constexpr char weights[] = "weights";
// KV cache and activations, class cache: never copied on sleep; woken last.
inline constexpr char kv_cache[] = "kv_cache";
// Memory that captured CUDA graphs own (their buffers and workspaces).
inline constexpr char cuda_graph[] = "cuda_graph";

}  // namespace torpor::tags
