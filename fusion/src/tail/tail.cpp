// make_tail: the collective choice between the fused and the unfused tail, and what both paths
// share (argument checks). See fusion/tail.hpp for the contract.
//
// The choice: every rank states, in one all-gather, its shape and options (they must agree), any
// problem with them, whether it can run the fused kernel and whether it can run the multicast
// variant. Fused when every rank can (a collective AND: ranks never disagree); the multicast
// variant when every rank can run it and the symmetric heap's multicast decision says yes.
// Otherwise the unfused path, and rank 0 logs one warning naming the rank and the cause. Missing
// multicast never fails anything: it only selects the unicast variant.
//
// Where a tail's calls run (device kernels or the CPU reference) is make_tail_ops's choice, made
// once per tail from the driver's capabilities (tail_ops.hpp).
#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "tail/tail_impl.hpp"
#include "torpor/consensus.hpp"
#include "torpor/error.hpp"
#include "torpor/fusion/tail_state.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion {

const char* to_string(TailPath p) noexcept {
  switch (p) {
    case TailPath::fused_multicast: return "fused multicast";
    case TailPath::fused_unicast: return "fused unicast";
    case TailPath::unfused: return "unfused";
  }
  return "unknown";
}

const char* to_string(TailMode m) noexcept {
  switch (m) {
    case TailMode::all_reduce: return "all_reduce";
    case TailMode::reduce_scatter: return "reduce_scatter";
  }
  return "unknown";
}

TokenRange token_share(int tokens, int rank, int ranks) noexcept {
  if (ranks <= 0 || tokens <= 0) return {};
  auto r = kernels::tail_token_share(tokens, rank, ranks);
  return {r.begin, r.end};
}

namespace detail {

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

}  // namespace

TailBase::TailBase(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, TailPath path,
                   std::string reason)
    : heap_(heap),
      pool_(heap.pool()),
      group_(heap.group()),
      shape_(shape),
      options_(options),
      path_(path),
      reason_(std::move(reason)),
      rank_(heap.group().rank()),
      ranks_(heap.group().size()),
      device_(heap.pool().device()),
      ops_(make_tail_ops(heap, shape, options, [this] { return who(); })) {}

std::string TailBase::who() const {
  return fmt::format("tail ({}) rank {} of {} (device {})", to_string(path_), rank_, ranks_, device_);
}

kernels::TailParams TailBase::params(const TailArgs& a, Stream stream) const {
  if (a.tokens < 1 || a.tokens > shape_.max_tokens)
    throw invalid_argument(fmt::format("{}: TailArgs::tokens is {}; it must be 1 .. max_tokens ({}) (raise "
                                       "TailShape::max_tokens)",
                                       who(), a.tokens, shape_.max_tokens));
  struct Field {
    const char* name;
    const void* p;
  };
  for (Field f : {Field{"expert_out", a.expert_out}, Field{"residual_in", a.residual_in}, Field{"gamma", a.gamma},
                  Field{"residual_out", a.residual_out}, Field{"norm_out", a.norm_out}}) {
    if (f.p == nullptr) throw invalid_argument(fmt::format("{}: TailArgs::{} is null", who(), f.name));
    if (!aligned16(f.p))
      throw invalid_argument(fmt::format("{}: TailArgs::{} ({}) is not 16-byte aligned; the kernels move 16-byte "
                                         "vectors",
                                         who(), f.name, f.p));
  }
  if (a.topk_weights == nullptr || (reinterpret_cast<std::uintptr_t>(a.topk_weights) & 3u) != 0)
    throw invalid_argument(
        fmt::format("{}: TailArgs::topk_weights must be a non-null, 4-byte aligned float array", who()));
  if (shape_.shared_expert && (a.shared_out == nullptr || !aligned16(a.shared_out)))
    throw invalid_argument(fmt::format("{}: the shape has a shared expert, so TailArgs::shared_out must be a 16-byte "
                                       "aligned [tokens][hidden] tensor",
                                       who()));
  if (!shape_.shared_expert && a.shared_out != nullptr)
    throw invalid_argument(fmt::format("{}: TailArgs::shared_out is set but the shape has no shared expert (set "
                                       "TailShape::shared_expert)",
                                       who()));
  ops_->check_stream(stream);

  kernels::TailParams p;
  p.expert_out = a.expert_out;
  p.topk_weights = a.topk_weights;
  p.shared_out = a.shared_out;
  p.residual_in = a.residual_in;
  p.gamma = a.gamma;
  p.residual_out = a.residual_out;
  p.norm_out = a.norm_out;
  p.tokens = a.tokens;
  p.hidden = shape_.hidden;
  p.top_k = shape_.top_k;
  p.max_tokens = shape_.max_tokens;
  p.ranks = ranks_;
  p.rank = rank_;
  p.eps = shape_.eps;
  p.reduce_scatter = shape_.mode == TailMode::reduce_scatter;
  p.timeout_ns =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(options_.wait_timeout).count());
  p.trace = static_cast<kernels::TailTrace*>(options_.trace);
  return p;
}

namespace {

// What one rank states in make_tail's all-gather: the shape is the request every rank must share;
// the rest travels alongside it.
struct Verdict {
  std::string shape;          // shape and options, which every rank must share
  std::string shape_problem;  // "" = fine
  std::string fused_why_not;  // "" = this rank can run the fused kernel
  std::string multicast_why_not;
};

// Every rank's verdict, indexed by rank (one all-gather).
std::vector<Verdict> gather_verdicts(Group& group, const Verdict& mine) {
  consensus::Agreement a = consensus::compare_requests(group, mine.shape,
                                                       consensus::encode_fields({mine.shape_problem, mine.fused_why_not,
                                                                                 mine.multicast_why_not}));
  std::vector<Verdict> all;
  for (std::size_t r = 0; r < a.requests.size(); ++r) {
    auto f = consensus::decode_fields(a.extras[r], 3, fmt::format("make_tail: the verdict of rank {}", r));
    all.push_back({std::move(a.requests[r]), std::move(f[0]), std::move(f[1]), std::move(f[2])});
  }
  return all;
}

std::string shape_key(const TailShape& s, const TailOptions& o) {
  return fmt::format("hidden {}, max_tokens {}, top_k {}, shared_expert {}, eps {}, mode {}, allow_fused {}, "
                     "wait_timeout {} ms, blocks_per_row {}",
                     s.hidden, s.max_tokens, s.top_k, s.shared_expert, s.eps, to_string(s.mode), o.allow_fused,
                     o.wait_timeout.count(), o.blocks_per_row);
}

std::string shape_problem(const TailShape& s, const TailOptions& o) {
  using kernels::tail_hidden_multiple;
  using kernels::tail_max_hidden;
  if (s.hidden < tail_hidden_multiple || s.hidden > tail_max_hidden || s.hidden % tail_hidden_multiple != 0)
    return fmt::format("TailShape::hidden is {}; it must be a multiple of {} between {} and {}", s.hidden,
                       tail_hidden_multiple, tail_hidden_multiple, tail_max_hidden);
  if (s.max_tokens < 1 || s.max_tokens > 65536)
    return fmt::format("TailShape::max_tokens is {}; it must be 1 .. 65536", s.max_tokens);
  if (s.top_k < 1 || s.top_k > 256) return fmt::format("TailShape::top_k is {}; it must be 1 .. 256", s.top_k);
  if (!(s.eps > 0.0f) || !std::isfinite(s.eps)) return fmt::format("TailShape::eps is {}; it must be positive", s.eps);
  if (s.mode != TailMode::all_reduce && s.mode != TailMode::reduce_scatter) return "TailShape::mode is not a TailMode";
  if (o.wait_timeout.count() <= 0)
    return fmt::format("TailOptions::wait_timeout is {} ms; it must be positive", o.wait_timeout.count());
  if (o.blocks_per_row != 0 && o.blocks_per_row != 1 && o.blocks_per_row != 4 && o.blocks_per_row != 8)
    return fmt::format("TailOptions::blocks_per_row is {}; it must be 0 (chosen per call), 1, 4 or 8",
                       o.blocks_per_row);
  return "";
}

// Whether this rank can run the fused kernel (and its multicast variant): "" = yes.
void probe_fused(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options, Verdict& v) {
  const int ranks = heap.group().size();
  if (!options.allow_fused) {
    v.fused_why_not = "TailOptions::allow_fused is false";
  } else if (ranks < 2) {
    v.fused_why_not = "a single rank has nothing to all-reduce";
  } else if (ranks > kernels::tail_max_ranks) {
    v.fused_why_not = fmt::format("{} ranks; the fused tail supports 2 to {}", ranks, kernels::tail_max_ranks);
  } else {
    // A failure here is this rank's verdict, not a throw: the other ranks are waiting for it.
    try {
      std::string who = fmt::format("make_tail on rank {}", heap.group().rank());
      FusedSupport s = make_tail_ops(heap, shape, options, [who = std::move(who)] { return who; })->fused_support();
      v.fused_why_not = std::move(s.fused_why_not);
      v.multicast_why_not = std::move(s.multicast_why_not);
    } catch (const std::exception& e) {
      v.fused_why_not = e.what();
    }
  }
  if (!v.fused_why_not.empty() && v.multicast_why_not.empty()) v.multicast_why_not = "no fused kernel";
}

}  // namespace

std::unique_ptr<TailOps> make_tail_ops(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options,
                                       TailName who) {
  if (heap.pool().driver().capabilities().compute == DriverCapabilities::Compute::cpu_reference)
    return make_reference_tail_ops(heap, shape, options, std::move(who));
#if defined(TORPOR_KERNELS_CUDA)
  return make_cuda_tail_ops(heap, shape, options, std::move(who));
#else
  throw unavailable(fmt::format("the {} driver runs device kernels, and this build has no CUDA kernels (configure "
                                "with TORPOR_CUDA=ON)",
                                heap.pool().driver().backend_name()));
#endif
}

}  // namespace detail

std::unique_ptr<Tail> make_tail(SymmetricHeap& heap, const TailShape& shape, const TailOptions& options) {
  using namespace detail;
  Group& group = heap.group();
  const int rank = group.rank();

  Verdict mine;
  mine.shape = shape_key(shape, options);
  mine.shape_problem = shape_problem(shape, options);
  if (mine.shape_problem.empty()) probe_fused(heap, shape, options, mine);
  const std::vector<Verdict> all = gather_verdicts(group, mine);

  for (std::size_t r = 0; r < all.size(); ++r) {
    if (!all[r].shape_problem.empty())
      throw invalid_argument(fmt::format("make_tail on rank {}: rank {}: {}", rank, r, all[r].shape_problem));
    if (all[r].shape != all[0].shape)
      throw invalid_argument(
          fmt::format("make_tail on rank {}: the ranks disagree on the shape or options (rank 0: {}; "
                      "rank {}: {}); every rank must pass the same",
                      rank, all[0].shape, r, all[r].shape));
  }
  std::string unfused_why, multicast_why;
  for (std::size_t r = 0; r < all.size() && unfused_why.empty(); ++r)
    if (!all[r].fused_why_not.empty()) unfused_why = fmt::format("rank {}: {}", r, all[r].fused_why_not);
  for (std::size_t r = 0; r < all.size() && multicast_why.empty(); ++r)
    if (!all[r].multicast_why_not.empty()) multicast_why = fmt::format("rank {}: {}", r, all[r].multicast_why_not);

  if (unfused_why.empty()) {
    try {
      return std::make_unique<FusedTail>(heap, shape, options, multicast_why.empty(), multicast_why);
    } catch (const group_timeout&) {
      throw;  // a rank went missing: the group needs recovery, not another path
    } catch (const driver_error& e) {
      unfused_why = fmt::format("the fused tail's state could not be set up: {}", e.what());
    } catch (const out_of_memory& e) {
      unfused_why = fmt::format("the fused tail's state could not be set up: {}", e.what());
    } catch (const setup_failed& e) {
      unfused_why = e.what();
    }
  }
  const bool asked_for_unfused = !options.allow_fused || group.size() < 2;
  if (rank == 0) {
    if (asked_for_unfused)
      log::info("tail: unfused path ({})", unfused_why);
    else
      log::warn("tail: falling back to the unfused path (finalize, all-reduce, residual + RMSNorm): {}", unfused_why);
  }
  return std::make_unique<UnfusedTail>(heap, shape, options, "unfused: " + unfused_why);
}

std::optional<TailState> tail_state(const Tail& tail) {
  auto* f = dynamic_cast<const detail::FusedTail*>(&tail);
  if (f == nullptr) return std::nullopt;
  TailState s;
  s.control = f->control();
  s.control_bytes = sizeof(kernels::TailControl);
  s.slots = f->slots();
  s.slot_bytes = f->slot_bytes();
  const detail::FusedLaunch launch = f->launch();
  s.capacity_blocks = launch.many_rows.capacity;
  s.blocks_per_row_few_rows = launch.few_rows.blocks_per_row;
  s.blocks_per_row_many_rows = launch.many_rows.blocks_per_row;
  return s;
}

}  // namespace torpor::fusion
