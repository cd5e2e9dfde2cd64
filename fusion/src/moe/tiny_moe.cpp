// TinyMoeLM (tiny_moe.hpp). Design notes:
//   - Everything is allocated in the constructor; generate() only writes the prompts and the
//     position, then runs decode steps. That is what makes one captured step valid forever: the
//     addresses it baked in never change (sleep keeps them) and nothing it reads is host state.
//   - Parameters know how to regenerate themselves (Param::fill, from a WeightVersion), which is
//     the whole of "reload the weights from the seed".
//   - The position table is computed here, once, and is state: a level-2 sleep must keep it,
//     and load_weights() never touches it. Losing it would change every token.
//   - Collective calls (the runners' make_tail, every tail run) happen in the same order on
//     every rank: layers in order, steps in order.
#include "torpor/fusion/tiny_moe.hpp"

#include <fmt/core.h>
#include <fnmatch.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "moe/expert_sharding.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion {

struct TinyMoeLM::Param {
  std::string name;
  bf16* ptr = nullptr;
  std::size_t count = 0;
  std::function<void(const WeightVersion&, bf16*)> fill;
};

struct TinyMoeLM::Layer {
  bf16* attn_norm = nullptr;
  bf16* wqkv = nullptr;  // [3 * head_dim][hidden]
  bf16* wo = nullptr;    // [hidden][head_dim]
  bf16* moe_norm = nullptr;
  LatentMoEWeights moe;
  bf16* k_cache = nullptr;  // [max_batch][max_seq][head_dim]
  bf16* v_cache = nullptr;
  std::unique_ptr<LatentMoERunner> runner;
};

namespace {

using clock_type = std::chrono::steady_clock;

void require(bool ok, const std::string& what) {
  if (!ok) throw invalid_argument("TinyMoeLM: " + what);
}

void validate(const TinyMoeConfig& c, int ranks) {
  const std::string sharding = expert_sharding_problem(c.inter, c.shared_inter, ranks);
  require(sharding.empty(), sharding);
  require(c.vocab >= 2, fmt::format("vocab = {} must be at least 2", c.vocab));
  require(c.hidden > 0 && c.hidden % 64 == 0,
          fmt::format("hidden = {} must be a positive multiple of 64 (the tail's requirement)", c.hidden));
  require(c.layers >= 1, fmt::format("layers = {} must be at least 1", c.layers));
  require(c.head_dim >= 1, fmt::format("head_dim = {} must be at least 1", c.head_dim));
  require(c.max_batch >= 1, fmt::format("max_batch = {} must be at least 1", c.max_batch));
  require(c.max_seq >= 2 && c.max_seq <= kernels::max_attention_seq,
          fmt::format("max_seq = {} must be in [2, {}]", c.max_seq, kernels::max_attention_seq));
}

// Fills for the host copy of a parameter.
auto dense(const std::string& logical, float scale, std::size_t count) {
  std::uint64_t h = weight_name_hash(logical);
  return [h, scale, count](const WeightVersion& v, bf16* out) {
    for (std::size_t i = 0; i < count; ++i) out[i] = bf16::from_float(scale * weight_value(v, h, i));
  };
}

auto norm(const std::string& logical, std::size_t count) {
  std::uint64_t h = weight_name_hash(logical);
  return [h, count](const WeightVersion& v, bf16* out) {
    for (std::size_t i = 0; i < count; ++i) out[i] = bf16::from_float(1.0f + 0.1f * weight_value(v, h, i));
  };
}

// This rank's slice [E][2 * I_r][latent] of logical gate and up, each [E][inter][latent].
auto gate_up_shard(const std::string& prefix, int experts, int inter, int latent, int rank, int ranks) {
  std::uint64_t hg = weight_name_hash(prefix + ".gate"), hu = weight_name_hash(prefix + ".up");
  const float scale = 1.0f / std::sqrt(static_cast<float>(latent));
  return [=](const WeightVersion& v, bf16* out) {
    const std::size_t ir = static_cast<std::size_t>(inter / ranks), L = static_cast<std::size_t>(latent);
    std::size_t o = 0;
    for (std::size_t e = 0; e < static_cast<std::size_t>(experts); ++e)
      for (std::size_t j = 0; j < 2 * ir; ++j) {
        const bool gate = j < ir;
        const std::size_t row =
            e * static_cast<std::size_t>(inter) + static_cast<std::size_t>(rank) * ir + (gate ? j : j - ir);
        for (std::size_t c = 0; c < L; ++c)
          out[o++] = bf16::from_float(scale * weight_value(v, gate ? hg : hu, row * L + c));
      }
  };
}

// This rank's columns [E][latent][I_r] of logical down [E][latent][inter].
auto down_shard(const std::string& logical, int experts, int inter, int latent, int rank, int ranks) {
  std::uint64_t h = weight_name_hash(logical);
  const float scale = 1.0f / std::sqrt(static_cast<float>(inter));
  return [=](const WeightVersion& v, bf16* out) {
    const std::size_t ir = static_cast<std::size_t>(inter / ranks);
    std::size_t o = 0;
    for (std::size_t e = 0; e < static_cast<std::size_t>(experts); ++e)
      for (std::size_t r = 0; r < static_cast<std::size_t>(latent); ++r)
        for (std::size_t c = 0; c < ir; ++c) {
          std::size_t idx = (e * static_cast<std::size_t>(latent) + r) * static_cast<std::size_t>(inter) +
                            static_cast<std::size_t>(rank) * ir + c;
          out[o++] = bf16::from_float(scale * weight_value(v, h, idx));
        }
  };
}

bool matches_any(const std::string& name, const std::vector<std::string>& globs) {
  for (const auto& g : globs)
    if (::fnmatch(g.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

}  // namespace

template <typename T>
T* TinyMoeLM::alloc(std::size_t count, const std::string& tag, MemoryClass cls, const std::string& name) {
  void* p = pool_.allocate(count * sizeof(T), {tag, cls, name});
  allocations_.push_back(p);
  return static_cast<T*>(p);
}

bf16* TinyMoeLM::param(std::size_t count, const std::string& name,
                       std::function<void(const WeightVersion&, bf16*)> fill) {
  bf16* p = alloc<bf16>(count, tags::weights, MemoryClass::parameter, name);
  params_.push_back({name, p, count, std::move(fill)});
  return p;
}

void TinyMoeLM::build_params() {
  const auto& c = config_;
  const std::size_t V = static_cast<std::size_t>(c.vocab), H = static_cast<std::size_t>(c.hidden),
                    D = static_cast<std::size_t>(c.head_dim), E = static_cast<std::size_t>(c.experts),
                    L = static_cast<std::size_t>(c.latent);
  const std::size_t ir = static_cast<std::size_t>(c.inter / ranks_),
                    sr = static_cast<std::size_t>(c.shared_inter / ranks_);
  const float sH = 1.0f / std::sqrt(static_cast<float>(H)), sD = 1.0f / std::sqrt(static_cast<float>(D)),
              sL = 1.0f / std::sqrt(static_cast<float>(L));
  tok_emb_ = param(V * H, "tok_emb", dense("tok_emb", 1.0f, V * H));
  layers_.resize(static_cast<std::size_t>(c.layers));
  for (int l = 0; l < c.layers; ++l) {
    Layer& y = layers_[static_cast<std::size_t>(l)];
    const std::string p = fmt::format("layers.{}", l);
    y.attn_norm = param(H, p + ".attn_norm", norm(p + ".attn_norm", H));
    y.wqkv = param(3 * D * H, p + ".attn.wqkv", dense(p + ".attn.wqkv", sH, 3 * D * H));
    y.wo = param(H * D, p + ".attn.wo", dense(p + ".attn.wo", sD, H * D));
    y.moe_norm = param(H, p + ".moe_norm", norm(p + ".moe_norm", H));
    y.moe.router = param(E * H, p + ".moe.router", dense(p + ".moe.router", sH, E * H));
    y.moe.down = param(L * H, p + ".moe.down", dense(p + ".moe.down", sH, L * H));
    y.moe.experts_gate_up = param(E * 2 * ir * L, p + ".moe.experts.gate_up",
                                  gate_up_shard(p + ".moe.experts", c.experts, c.inter, c.latent, rank_, ranks_));
    y.moe.experts_down = param(E * L * ir, p + ".moe.experts.down",
                               down_shard(p + ".moe.experts.down", c.experts, c.inter, c.latent, rank_, ranks_));
    if (sr > 0) {
      y.moe.shared_gate_up = param(2 * sr * L, p + ".moe.shared.gate_up",
                                   gate_up_shard(p + ".moe.shared", 1, c.shared_inter, c.latent, rank_, ranks_));
      y.moe.shared_down = param(L * sr, p + ".moe.shared.down",
                                down_shard(p + ".moe.shared.down", 1, c.shared_inter, c.latent, rank_, ranks_));
    }
    y.moe.up = param(H * L, p + ".moe.up", dense(p + ".moe.up", sL, H * L));
  }
  final_norm_ = param(H, "final_norm", norm("final_norm", H));
  lm_head_ = param(V * H, "lm_head", dense("lm_head", sH, V * H));
}

TinyMoeLM::TinyMoeLM(SymmetricHeap& heap, Compute& compute, const TinyMoeConfig& config, const WeightVersion& version,
                     const TinyMoeOptions& options)
    : pool_(heap.pool()),
      compute_(compute),
      config_(config),
      options_(options),
      rank_(heap.group().rank()),
      ranks_(heap.group().size()) {
  validate(config_, ranks_);
  const auto& c = config_;
  const std::size_t B = static_cast<std::size_t>(c.max_batch), S = static_cast<std::size_t>(c.max_seq),
                    H = static_cast<std::size_t>(c.hidden), D = static_cast<std::size_t>(c.head_dim),
                    V = static_cast<std::size_t>(c.vocab);
  // Runners are created in the loop below, collectively; a local failure before that would leave
  // the other ranks waiting in make_tail, so everything local that can fail on bad input was
  // validated above (the runner validates its own config before its collective call too).
  try {
    build_params();
    pos_table_ = alloc<bf16>(S * H, tags::weights, MemoryClass::state, "pos_table");
    for (int l = 0; l < c.layers; ++l) {
      Layer& y = layers_[static_cast<std::size_t>(l)];
      y.k_cache = alloc<bf16>(B * S * D, tags::kv_cache, MemoryClass::cache, fmt::format("layers.{}.k_cache", l));
      y.v_cache = alloc<bf16>(B * S * D, tags::kv_cache, MemoryClass::cache, fmt::format("layers.{}.v_cache", l));
    }
    seq_ = alloc<std::int32_t>(B * S, tags::kv_cache, MemoryClass::cache, "decode.seq");
    control_ = alloc<std::int32_t>(2, tags::kv_cache, MemoryClass::cache, "decode.control");
    x_ = alloc<bf16>(B * H, tags::kv_cache, MemoryClass::cache, "decode.x");
    xn_ = alloc<bf16>(B * H, tags::kv_cache, MemoryClass::cache, "decode.x_norm");
    h_ = alloc<bf16>(B * H, tags::kv_cache, MemoryClass::cache, "decode.h");
    hn_ = alloc<bf16>(B * H, tags::kv_cache, MemoryClass::cache, "decode.h_norm");
    qkv_ = alloc<bf16>(B * 3 * D, tags::kv_cache, MemoryClass::cache, "decode.qkv");
    att_ = alloc<bf16>(B * D, tags::kv_cache, MemoryClass::cache, "decode.attn");
    o_ = alloc<bf16>(B * H, tags::kv_cache, MemoryClass::cache, "decode.attn_out");
    logits_ = alloc<float>(B * V, tags::kv_cache, MemoryClass::cache, "decode.logits");
    if (std::size_t ws = compute_.workspace_bytes(); ws > 0)
      compute_.set_workspace(alloc<std::byte>(ws, tags::kv_cache, MemoryClass::cache, "compute.workspace"), ws);

    // Computed at load, never reloaded: the sinusoidal position table.
    std::vector<bf16> table(S * H);
    for (std::size_t p = 0; p < S; ++p)
      for (std::size_t i = 0; i < H; i += 2) {
        double freq = std::pow(10000.0, -static_cast<double>(i) / static_cast<double>(H));
        table[p * H + i] = bf16::from_float(static_cast<float>(std::sin(static_cast<double>(p) * freq)));
        if (i + 1 < H)
          table[p * H + i + 1] = bf16::from_float(static_cast<float>(std::cos(static_cast<double>(p) * freq)));
      }
    pool_.copy(pos_table_, table.data(), table.size() * sizeof(bf16));

    for (int l = 0; l < c.layers; ++l) {
      LatentMoEConfig mc;
      mc.hidden = c.hidden;
      mc.latent = c.latent;
      mc.experts = c.experts;
      mc.top_k = c.top_k;
      mc.inter = c.inter;
      mc.shared_inter = c.shared_inter;
      mc.max_tokens = c.max_batch;
      mc.eps = c.eps;
      LatentMoEOptions mo;
      mo.name = fmt::format("layers.{}.moe", l);
      mo.tail = options_.tail;
      Layer& y = layers_[static_cast<std::size_t>(l)];
      y.runner = std::make_unique<LatentMoERunner>(heap, compute_, mc, y.moe, mo);
    }
    load_weights(version);
  } catch (...) {
    release();
    throw;
  }
}

TinyMoeLM::~TinyMoeLM() { release(); }

void TinyMoeLM::release() noexcept {
  graphs_.clear();  // graphs before the tails they captured (and before any communicator)
  for (auto& y : layers_) y.runner.reset();
  for (void* p : allocations_) {
    try {
      pool_.deallocate(p);
    } catch (const std::exception& e) {
      log::error("tiny MoE model (rank {}): freeing {} failed: {}", rank_, p, e.what());
    }
  }
  allocations_.clear();
}

LoadReport TinyMoeLM::load_weights(const WeightVersion& version, const std::vector<std::string>& skip) {
  auto t = clock_type::now();
  LoadReport r;
  std::vector<bf16> host;
  for (const Param& p : params_) {
    const std::size_t bytes = p.count * sizeof(bf16);
    if (matches_any(p.name, skip)) {
      ++r.tensors_skipped;
      r.bytes_skipped += bytes;
      continue;
    }
    host.resize(p.count);
    p.fill(version, host.data());
    pool_.copy(p.ptr, host.data(), bytes);
    ++r.tensors_loaded;
    r.bytes_loaded += bytes;
  }
  r.seconds = std::chrono::duration<double>(clock_type::now() - t).count();
  return r;
}

void TinyMoeLM::enqueue_step(int batch) {
  const auto& c = config_;
  Compute& k = compute_;
  const int B = batch, H = c.hidden, D = c.head_dim, S = c.max_seq, V = c.vocab;
  k.embed(seq_, S, control_, tok_emb_, V, pos_table_, x_, B, H);
  k.rmsnorm(x_, layers_.front().attn_norm, xn_, B, H, c.eps);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    Layer& y = layers_[l];
    k.linear(xn_, y.wqkv, qkv_, B, 3 * D, H);
    k.attention_decode(qkv_, y.k_cache, y.v_cache, control_, att_, B, D, S);
    k.linear(att_, y.wo, o_, B, H, D);
    k.add_rmsnorm(x_, o_, y.moe_norm, h_, hn_, B, H, c.eps);
    const bf16* next_gamma = l + 1 < layers_.size() ? layers_[l + 1].attn_norm : final_norm_;
    y.runner->run(B, hn_, h_, next_gamma, x_, xn_);
  }
  k.linear(xn_, lm_head_, logits_, B, V, H);
  k.argmax_next(logits_, B, V, seq_, S, control_, control_ + 1);
  k.advance(control_);
}

void TinyMoeLM::run_step(int batch) {
  if (!options_.use_graphs || !compute_.graphs()) {
    enqueue_step(batch);
    ++stats_.eager_steps;
    return;
  }
  auto it = graphs_.find(batch);
  if (it != graphs_.end()) {
    it->second->replay();
    ++stats_.graph_replays;
    return;
  }
  // First step at this batch size: run it eagerly (libraries initialise lazily, outside any
  // capture), then capture the step for every later one. Capturing runs nothing.
  enqueue_step(batch);
  ++stats_.eager_steps;
  compute_.synchronize();
  graphs_[batch] = compute_.capture([&] { enqueue_step(batch); });
  ++stats_.graphs_captured;
}

std::vector<std::int32_t> TinyMoeLM::generate(const std::vector<std::int32_t>& prompts, int batch, int prompt_len,
                                              int new_tokens) {
  const auto& c = config_;
  if (batch < 1 || batch > c.max_batch)
    throw invalid_argument(fmt::format("generate: batch {} must be in [1, {}] (max_batch)", batch, c.max_batch));
  if (prompt_len < 1 || new_tokens < 1 || prompt_len + new_tokens > c.max_seq)
    throw invalid_argument(fmt::format("generate: prompt_len {} + new_tokens {} must fit max_seq {} (both at least 1)",
                                       prompt_len, new_tokens, c.max_seq));
  if (prompts.size() != static_cast<std::size_t>(batch) * static_cast<std::size_t>(prompt_len))
    throw invalid_argument(
        fmt::format("generate: {} prompt tokens given, batch x prompt_len = {}", prompts.size(), batch * prompt_len));
  const std::size_t S = static_cast<std::size_t>(c.max_seq);
  std::vector<std::int32_t> seq(static_cast<std::size_t>(batch) * S, 0);
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < prompt_len; ++i)
      seq[static_cast<std::size_t>(b) * S + static_cast<std::size_t>(i)] =
          prompts[static_cast<std::size_t>(b) * static_cast<std::size_t>(prompt_len) + static_cast<std::size_t>(i)];
  pool_.copy(seq_, seq.data(), seq.size() * sizeof(std::int32_t));
  const std::int32_t control[2] = {0, prompt_len};
  pool_.copy(control_, control, sizeof control);

  const int steps = prompt_len + new_tokens - 1;
  for (int s = 0; s < steps; ++s) {
    try {
      run_step(batch);
      compute_.synchronize();
      for (std::size_t l = 0; l < layers_.size(); ++l) layers_[l].runner->check();
    } catch (const timeout_error& e) {
      // A tail's bounded wait ran out, or its state is gone: the same error, saying where.
      throw timeout_error(fmt::format("rank {}: decode step {} of {}: {}", rank_, s, steps, e.what()));
    } catch (const invalid_state& e) {
      throw invalid_state(fmt::format("rank {}: decode step {} of {}: {}", rank_, s, steps, e.what()));
    }
  }
  pool_.copy(seq.data(), seq_, seq.size() * sizeof(std::int32_t));
  std::vector<std::int32_t> out(static_cast<std::size_t>(batch) * static_cast<std::size_t>(new_tokens));
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < new_tokens; ++i)
      out[static_cast<std::size_t>(b) * static_cast<std::size_t>(new_tokens) + static_cast<std::size_t>(i)] =
          seq[static_cast<std::size_t>(b) * S + static_cast<std::size_t>(prompt_len + i)];
  return out;
}

std::vector<ParameterInfo> TinyMoeLM::parameters() const {
  std::vector<ParameterInfo> out;
  out.reserve(params_.size());
  for (const Param& p : params_) out.push_back({p.name, p.ptr, p.count * sizeof(bf16)});
  return out;
}

std::size_t TinyMoeLM::parameter_bytes() const noexcept {
  std::size_t n = 0;
  for (const Param& p : params_) n += p.count * sizeof(bf16);
  return n;
}

std::vector<TailPath> TinyMoeLM::tail_paths() const {
  std::vector<TailPath> out;
  out.reserve(layers_.size());
  for (const auto& y : layers_) out.push_back(y.runner->path());
  return out;
}

std::vector<std::string> TinyMoeLM::tail_reasons() const {
  std::vector<std::string> out;
  out.reserve(layers_.size());
  for (const auto& y : layers_) out.push_back(y.runner->reason());
  return out;
}

std::vector<TailState> TinyMoeLM::tail_states() const {
  std::vector<TailState> out;
  for (const auto& y : layers_)
    if (auto s = y.runner->tail_state()) out.push_back(*s);
  return out;
}

}  // namespace torpor::fusion
