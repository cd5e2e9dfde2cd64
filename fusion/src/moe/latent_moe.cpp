// LatentMoERunner (latent_moe.hpp). The runner is a fixed sequence of Compute calls over
// buffers allocated once at construction, so the sequence can be captured in a CUDA graph and
// replayed through sleep: every address it uses (weights, expert tables, scratch, the tail's
// state) stays fixed, and nothing is allocated or read back on the host in run().
//
// Invariants: the expert tables are written once, here, and never again (state: a level-2
// sleep keeps them); everything the runner writes in run() is scratch (cache) or the caller's
// outputs. The tail is created before any allocation of ours so its collective calls are made in
// the same order on every rank whatever happens locally.
#include "torpor/fusion/latent_moe.hpp"

#include <fmt/core.h>

#include <algorithm>

#include "moe/expert_sharding.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion {

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw invalid_argument("LatentMoERunner: " + what);
}

void validate(const LatentMoEConfig& c, const LatentMoEWeights& w, int ranks) {
  require(c.hidden > 0 && c.hidden % 64 == 0 && c.hidden <= 8192,
          fmt::format("hidden = {} must be a positive multiple of 64, at most 8192 (the tail's limit)", c.hidden));
  require(c.latent > 0, fmt::format("latent = {} must be positive", c.latent));
  require(c.top_k >= 1 && c.top_k <= kernels::max_top_k,
          fmt::format("top_k = {} must be in [1, {}]", c.top_k, kernels::max_top_k));
  require(c.experts >= c.top_k && c.experts <= kernels::max_experts,
          fmt::format("experts = {} must be in [top_k = {}, {}]", c.experts, c.top_k, kernels::max_experts));
  const std::string sharding = expert_sharding_problem(c.inter, c.shared_inter, ranks);
  require(sharding.empty(), sharding);
  require(c.max_tokens >= 1, fmt::format("max_tokens = {} must be at least 1", c.max_tokens));
  require(w.router && w.down && w.experts_gate_up && w.experts_down && w.up,
          "a weight pointer is null (router, down, experts_gate_up, experts_down and up are required)");
  require(c.shared_inter == 0 || (w.shared_gate_up && w.shared_down),
          "shared_inter > 0 needs shared_gate_up and shared_down");
}

}  // namespace

template <typename T>
T* LatentMoERunner::scratch(std::size_t count, const char* what) {
  void* p = pool_.allocate(std::max<std::size_t>(count, 1) * sizeof(T),
                           {options_.scratch_tag, MemoryClass::cache, options_.name + ".scratch." + what});
  allocations_.push_back(p);
  return static_cast<T*>(p);
}

LatentMoERunner::LatentMoERunner(SymmetricHeap& heap, Compute& compute, const LatentMoEConfig& config,
                                 const LatentMoEWeights& weights, const LatentMoEOptions& options)
    : pool_(heap.pool()),
      compute_(compute),
      config_(config),
      weights_(weights),
      options_(options),
      rank_(heap.group().rank()),
      ranks_(heap.group().size()) {
  validate(config_, weights_, ranks_);
  inter_r_ = config_.inter / ranks_;
  shared_r_ = config_.shared_inter / ranks_;

  // The tail first (collective).
  TailShape shape;
  shape.hidden = config_.hidden;
  shape.max_tokens = config_.max_tokens;
  shape.top_k = config_.top_k;
  shape.shared_expert = config_.shared_inter > 0;
  shape.eps = config_.eps;
  tail_ = make_tail(heap, shape, options_.tail);

  try {
    const int E = config_.experts, T = config_.max_tokens, K = config_.top_k, L = config_.latent, H = config_.hidden;
    const std::size_t count = static_cast<std::size_t>(T) * K;

    // State computed at load: where each expert's slices start.
    std::vector<const bf16*> gu(static_cast<std::size_t>(E)), dn(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) {
      gu[static_cast<std::size_t>(e)] = weights_.experts_gate_up + static_cast<std::size_t>(e) * 2 * inter_r_ * L;
      dn[static_cast<std::size_t>(e)] = weights_.experts_down + static_cast<std::size_t>(e) * L * inter_r_;
    }
    // A table of device pointers: the pointer's size is meant.
    const std::size_t table_bytes =
        static_cast<std::size_t>(E) * sizeof(const bf16*);  // NOLINT(bugprone-sizeof-expression)
    gate_up_table_ = static_cast<const bf16**>(
        pool_.allocate(table_bytes, {tags::weights, MemoryClass::state, options_.name + ".experts.gate_up_table"}));
    allocations_.push_back(static_cast<void*>(gate_up_table_));
    down_table_ = static_cast<const bf16**>(
        pool_.allocate(table_bytes, {tags::weights, MemoryClass::state, options_.name + ".experts.down_table"}));
    allocations_.push_back(static_cast<void*>(down_table_));
    pool_.copy(static_cast<void*>(gate_up_table_), static_cast<const void*>(gu.data()), table_bytes);
    pool_.copy(static_cast<void*>(down_table_), static_cast<const void*>(dn.data()), table_bytes);

    x_lat_ = scratch<bf16>(static_cast<std::size_t>(T) * L, "x_lat");
    router_logits_ = scratch<float>(static_cast<std::size_t>(T) * E, "router_logits");
    topk_idx_ = scratch<std::int32_t>(count, "topk_idx");
    topk_w_ = scratch<float>(count, "topk_weights");
    gate_up_ = scratch<bf16>(count * 2 * static_cast<std::size_t>(inter_r_), "gate_up");
    act_ = scratch<bf16>(count * static_cast<std::size_t>(inter_r_), "act");
    y_lat_ = scratch<bf16>(count * static_cast<std::size_t>(L), "y_lat");
    expert_out_ = scratch<bf16>(count * static_cast<std::size_t>(H), "expert_out");
    void** ptrs = scratch<void*>(6 * count, "expert_pointers");
    auto at = [&](int i) { return static_cast<void*>(ptrs + static_cast<std::size_t>(i) * count); };
    pointers_.gate_up_x = static_cast<const bf16**>(at(0));
    pointers_.gate_up_w = static_cast<const bf16**>(at(1));
    pointers_.gate_up_y = static_cast<bf16**>(at(2));
    pointers_.down_x = static_cast<const bf16**>(at(3));
    pointers_.down_w = static_cast<const bf16**>(at(4));
    pointers_.down_y = static_cast<bf16**>(at(5));
    if (shared_r_ > 0) {
      shared_gate_up_ = scratch<bf16>(static_cast<std::size_t>(T) * 2 * shared_r_, "shared_gate_up");
      shared_act_ = scratch<bf16>(static_cast<std::size_t>(T) * shared_r_, "shared_act");
      shared_lat_ = scratch<bf16>(static_cast<std::size_t>(T) * L, "shared_lat");
      shared_out_ = scratch<bf16>(static_cast<std::size_t>(T) * H, "shared_out");
    }
  } catch (...) {
    release();
    throw;
  }
}

LatentMoERunner::~LatentMoERunner() { release(); }

void LatentMoERunner::release() noexcept {
  tail_.reset();  // the tail op's destructor is local and does not throw (fusion/tail.hpp)
  for (void* p : allocations_) {
    try {
      pool_.deallocate(p);
    } catch (const std::exception& e) {
      log::error("{} (rank {}): freeing {} failed: {}", options_.name, rank_, p, e.what());
    }
  }
  allocations_.clear();
}

void LatentMoERunner::partials(int tokens, const bf16* x_norm) {
  if (tokens < 1 || tokens > config_.max_tokens)
    throw invalid_argument(fmt::format("{}: run with {} tokens; this runner takes 1 .. {} (max_tokens)", options_.name,
                                       tokens, config_.max_tokens));
  const int T = tokens, K = config_.top_k, E = config_.experts, L = config_.latent, H = config_.hidden;
  const int count = T * K;
  Compute& c = compute_;
  c.linear(x_norm, weights_.router, router_logits_, T, E, H);
  c.router_topk(router_logits_, T, E, K, topk_idx_, topk_w_);
  c.linear(x_norm, weights_.down, x_lat_, T, L, H);
  c.expert_pointers(topk_idx_, count, K, gate_up_table_, down_table_, E, x_lat_, L, gate_up_, inter_r_, act_, y_lat_,
                    pointers_);
  c.linear_batched(pointers_.gate_up_x, pointers_.gate_up_w, pointers_.gate_up_y, count, 2 * inter_r_, L);
  c.silu_mul(gate_up_, act_, count, inter_r_);
  c.linear_batched(pointers_.down_x, pointers_.down_w, pointers_.down_y, count, L, inter_r_);
  c.linear(y_lat_, weights_.up, expert_out_, count, H, L);
  if (shared_r_ > 0) {
    c.linear(x_lat_, weights_.shared_gate_up, shared_gate_up_, T, 2 * shared_r_, L);
    c.silu_mul(shared_gate_up_, shared_act_, T, shared_r_);
    c.linear(shared_act_, weights_.shared_down, shared_lat_, T, L, shared_r_);
    c.linear(shared_lat_, weights_.up, shared_out_, T, H, L);
  }
}

void LatentMoERunner::run(int tokens, const bf16* x_norm, const bf16* residual_in, const bf16* gamma,
                          bf16* residual_out, bf16* norm_out) {
  partials(tokens, x_norm);
  TailArgs a;
  a.tokens = tokens;
  a.expert_out = expert_out_;
  a.topk_weights = topk_w_;
  a.shared_out = shared_r_ > 0 ? shared_out_ : nullptr;
  a.residual_in = residual_in;
  a.gamma = gamma;
  a.residual_out = residual_out;
  a.norm_out = norm_out;
  tail_->run(a, compute_.stream());
}

void LatentMoERunner::check() { tail_->check(); }
TailPath LatentMoERunner::path() const noexcept { return tail_->path(); }
const std::string& LatentMoERunner::reason() const noexcept { return tail_->reason(); }
std::optional<TailState> LatentMoERunner::tail_state() const { return fusion::tail_state(*tail_); }

}  // namespace torpor::fusion
