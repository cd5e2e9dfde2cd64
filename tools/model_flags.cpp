// Shared model flags and per-rank engine for the CLI (model_flags.hpp).
#include "model_flags.hpp"

#include <fmt/core.h>

#include "launch.hpp"
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

void add_model_flags(CLI::App* cmd, ModelFlags& f) {
  auto& c = f.config;
  const char* g = "Model";
  cmd->add_option("--vocab", c.vocab, "Vocabulary size")->capture_default_str()->group(g);
  cmd->add_option("--hidden", c.hidden, "Hidden size (a multiple of 64)")->capture_default_str()->group(g);
  cmd->add_option("--layers", c.layers, "Layers")->capture_default_str()->group(g);
  cmd->add_option("--head-dim", c.head_dim, "Attention head size (one head)")->capture_default_str()->group(g);
  cmd->add_option("--experts", c.experts, "Routed experts per layer")->capture_default_str()->group(g);
  cmd->add_option("--top-k", c.top_k, "Experts per token")->capture_default_str()->group(g);
  cmd->add_option("--latent", c.latent, "Latent dimension the experts work in")->capture_default_str()->group(g);
  cmd->add_option("--inter", c.inter, "Expert intermediate size, sharded over the ranks (a multiple of --ranks)")
      ->capture_default_str()
      ->group(g);
  cmd->add_option("--shared-inter", c.shared_inter, "Shared expert intermediate size, sharded; 0 = no shared expert")
      ->capture_default_str()
      ->group(g);
  // Bounded so that prompt_len + new_tokens and every product of them with the batch fit in an
  // int (issue 33 N18: a signed overflow before).
  cmd->add_option("--prompts", f.prompts, "Prompts decoded together (the batch), 1 to 4096")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096))
      ->group(g);
  cmd->add_option("--prompt-len", f.prompt_len, "Tokens per prompt, 1 to 65536")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536))
      ->group(g);
  cmd->add_option("--new-tokens", f.new_tokens, "Tokens generated per prompt, 1 to 65536")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536))
      ->group(g);
  cmd->add_option("--seed", f.seed, "Seed of the dummy weights and prompts")->capture_default_str()->group(g);
  cmd->add_option("--wait-timeout-ms", f.wait_timeout_ms, "Bound on every wait of the MoE tail, in ms")
      ->capture_default_str()
      ->group(g);
  cmd->add_flag("--no-graphs", f.no_graphs, "Run decode steps eagerly instead of replaying CUDA graphs")->group(g);
  cmd->add_flag(
         "--unfused", f.unfused,
         "Take the tail's default (unfused) path even where the fused one can be built; the tokens must be the same")
      ->group(g);
}

void add_rank_run_flags(CLI::App* cmd, GroupTimeout& group_timeout, bool& progress, ModelFlags& model, bool& worker) {
  group_timeout.add_flags(cmd, "Bound on every group wait, in seconds (default: TORPOR_GROUP_TIMEOUT_MS when set)");
  cmd->add_flag(
      "--no-progress", [&progress](std::int64_t) { progress = false; }, "No progress line on the terminal");
  add_model_flags(cmd, model);
  cmd->add_flag("--worker", worker, "Internal: run as one rank (group from the environment)")->group("");
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
