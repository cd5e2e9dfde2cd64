// Shared model flags and per-rank engine for the CLI (model_flags.hpp).
#include "stress/model_flags.hpp"

#include <fmt/core.h>

#include "launch/launch.hpp"
#include "torpor/consensus.hpp"
#include "torpor/error.hpp"

namespace torpor::cli {

fusion::TinyMoeConfig ModelFlags::model_config() const {
  fusion::TinyMoeConfig c = config;
  c.max_batch = prompts;
  c.max_seq = prompt_len + new_tokens;
  return c;
}

fusion::TinyMoeOptions ModelFlags::model_options() const {
  fusion::TinyMoeOptions o;
  o.tail.wait_timeout = std::chrono::milliseconds(wait_timeout_ms);
  o.use_graphs = !no_graphs;
  o.tail.allow_fused = !unfused;
  return o;
}

std::vector<std::string> ModelFlags::args() const {
  const auto& c = config;
  std::vector<std::string> a =
      {"--vocab",        std::to_string(c.vocab),        "--hidden",          std::to_string(c.hidden),
       "--layers",       std::to_string(c.layers),       "--head-dim",        std::to_string(c.head_dim),
       "--experts",      std::to_string(c.experts),      "--top-k",           std::to_string(c.top_k),
       "--latent",       std::to_string(c.latent),       "--inter",           std::to_string(c.inter),
       "--shared-inter", std::to_string(c.shared_inter), "--prompts",         std::to_string(prompts),
       "--prompt-len",   std::to_string(prompt_len),     "--new-tokens",      std::to_string(new_tokens),
       "--seed",         std::to_string(seed),           "--wait-timeout-ms", std::to_string(wait_timeout_ms)};
  if (no_graphs) a.emplace_back("--no-graphs");
  if (unfused) a.emplace_back("--unfused");
  return a;
}

RankEngine::RankEngine(Driver& driver, Group& group, int device, const ModelFlags& flags, FillOnWake fill,
                       const std::vector<std::string>& preserve, const fusion::WeightVersion& version)
    : pool(driver,
           [&] {
             PoolOptions po;
             po.device = device;
             po.exportable = true;  // the tail's symmetric buffers are exported to the peers
             po.fill_on_wake = fill;
             return po;
           }()),
      heap(pool, group) {
  if (!preserve.empty()) pool.set_preserve(preserve);
  compute = fusion::make_compute(driver, device);
  model = std::make_unique<fusion::TinyMoeLM>(heap, *compute, flags.model_config(), version, flags.model_options());
}

Comparison compare_outputs(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b, int prompts) {
  Comparison c;
  if (a.size() != b.size() || prompts <= 0) {
    c.mismatched_tokens = std::max(a.size(), b.size());
    return c;
  }
  const std::size_t per = a.size() / static_cast<std::size_t>(prompts);
  for (int p = 0; p < prompts; ++p) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < per; ++i) bad += a[p * per + i] != b[p * per + i];
    c.mismatched_tokens += bad;
    c.matching_prompts += bad == 0;
  }
  return c;
}

std::string digest(const std::vector<std::int32_t>& tokens) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::int32_t t : tokens)
    for (int i = 0; i < 4; ++i) {
      h ^= static_cast<std::uint8_t>(static_cast<std::uint32_t>(t) >> (8 * i));
      h *= 0x100000001b3ull;
    }
  return fmt::format("{:016x}", h);
}

void agree_on_failures(Group& group, const std::string& step, const std::string& mine) {
  auto all = consensus::gather_outcomes(group, mine.empty() ? consensus::Outcome{} : consensus::Outcome::failed(mine));
  std::string text;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].ok()) continue;
    const std::string& s = all[r].message;
    const std::string who = fmt::format("rank {}: ", r);
    text += (text.empty() ? "" : "; ") + (s.starts_with(who) ? s : who + s);
  }
  if (!text.empty()) throw error(fmt::format("{}: {}", step, text));
}

}  // namespace torpor::cli
