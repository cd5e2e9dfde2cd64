// `torpor rl-loop`: the RL weight-update loop on the tiny MoE model, over N ranks (threads or
// processes). Each iteration:
//   sleep(2) -> a "training phase" that takes >= --train-fraction of the device memory the sleep
//   returned, outside every torpor pool (cudaMalloc; anonymous host memory on the host backend,
//   capped by --train-cap), and writes all of it -> frees it -> wake_up({"weights"}) -> loads the
//   next weight version (the seeded update applied once more) -> wake_up({"kv_cache"}) ->
//   generate; the outputs must equal, token for token, those of a freshly built model (new
//   compute, new tails, new allocations) loaded with the same version.
// Time per phase per iteration; exit 0 only when every iteration matched on every rank and the
// training phase really took its share of the returned memory.
#include "stress/rl_loop.hpp"

#include <fmt/core.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "commands.hpp"
#include "launch/launch.hpp"
#include "output.hpp"
#include "stress/model_flags.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"

namespace torpor::cli {

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

// The training phase: takes its share of what sleep returned, outside the pool, and writes all
// of it; records what it took in `row`.
void train_outside_the_pool(const RlOptions& o, RankEngine& e, std::size_t returned, std::size_t cap, int it,
                            nlohmann::json& row) {
  std::size_t want = static_cast<std::size_t>(static_cast<double>(returned) * o.train_fraction) / 8 * 8;
  std::size_t bytes = cap > 0 ? std::min(want, cap) : want;
  auto t = clock_type::now();
  void* p = e.compute->outside_allocate(bytes);
  std::uint64_t checksum = 0;
  try {
    checksum = e.compute->touch(p, bytes, o.model.seed ^ static_cast<std::uint64_t>(it));
  } catch (...) {
    e.compute->outside_free(p, bytes);
    throw;
  }
  e.compute->outside_free(p, bytes);
  row["train_s"] = since(t);
  row["train_bytes"] = bytes;
  row["train_fraction"] = static_cast<double>(bytes) / static_cast<double>(returned);
  row["train_capped"] = bytes < want;
  row["train_checksum"] = fmt::format("{:016x}", checksum);
}

// One iteration on this rank: sleep(2), train, wake weights, load the next version, wake the KV
// cache, generate. Returns the outputs; the timings go to `row`.
template <typename Generate>
std::vector<std::int32_t> rl_iteration(const RlOptions& o, RankEngine& e, Driver& driver, int device, int rank, int it,
                                       std::size_t cap, fusion::WeightVersion& version, const Generate& generate,
                                       nlohmann::json& row) {
  const std::size_t free0 = driver.memory_info(device).free_bytes;
  auto t = clock_type::now();
  TransitionReport sr = e.pool.sleep(2);
  row["sleep_s"] = since(t);
  const std::size_t free1 = driver.memory_info(device).free_bytes;
  const std::size_t returned = free1 > free0 ? free1 - free0 : 0;
  row["returned"] = returned;
  row["released"] = sr.bytes_released;
  if (returned == 0) throw error(fmt::format("rank {}: sleep(2) returned no device memory", rank));

  train_outside_the_pool(o, e, returned, cap, it, row);

  t = clock_type::now();
  e.pool.wake_up({tags::weights});
  row["wake_weights_s"] = since(t);
  version.updates = it;
  fusion::LoadReport lr = e.model->load_weights(version);
  row["load_s"] = lr.seconds;
  row["loaded_bytes"] = lr.bytes_loaded;
  t = clock_type::now();
  e.pool.wake_up({tags::kv_cache});
  row["wake_kv_s"] = since(t);
  t = clock_type::now();
  auto out = generate(*e.model);
  row["generate_s"] = since(t);
  return out;
}

nlohmann::json rl_rank(const RlOptions& o, Driver& driver, Group& group, int device) {
  const int rank = group.rank();
  Progress progress(rank == 0 && o.progress);
  fusion::WeightVersion version{o.model.seed, o.update_seed, 0, o.update_scale};
  RankEngine e(driver, group, device, o.model, FillOnWake::poison, {}, version);
  const auto prompts = fusion::make_prompts(o.model.seed, o.model.prompts, o.model.prompt_len, o.model.config.vocab);
  // Where pool memory is the machine's RAM (the host backend), "all the memory sleep returned" is
  // RAM too: the training phase takes at most --train-cap of it.
  const std::size_t cap = driver.capabilities().host_memory ? parse_size(o.train_cap) : 0;
  auto generate = [&](fusion::TinyMoeLM& m) {
    return m.generate(prompts, o.model.prompts, o.model.prompt_len, o.model.new_tokens);
  };

  nlohmann::json result = {{"rank", rank},
                           {"group_timeout_ms", group.timeout().count()},
                           {"device", device},
                           {"device_name", driver.device_properties(device).name},
                           {"backend", std::string(driver.backend_name())},
                           {"parameter_bytes", e.model->parameter_bytes()},
                           {"iterations", nlohmann::json::array()}};
  // Runs step on this rank, then every rank learns every rank's failure (and all throw together).
  auto agreed = [&](const std::string& name, const auto& step) {
    std::string err;
    try {
      step();
    } catch (const std::exception& ex) {
      err = ex.what();
    }
    try {
      agree_on_failures(group, name, err);
    } catch (const std::exception& ex) {
      progress.done();
      throw rank_failure(ex.what(), result);
    }
  };
  std::vector<std::int32_t> previous;
  agreed("first generate", [&] { previous = generate(*e.model); });
  for (int it = 1; it <= o.iterations; ++it) {
    progress.update(fmt::format("[rl-loop] iteration {}/{}", it, o.iterations));
    nlohmann::json row = {{"iteration", it}};
    std::vector<std::int32_t> out, ref;
    agreed(fmt::format("iteration {}", it),
           [&] { out = rl_iteration(o, e, driver, device, rank, it, cap, version, generate, row); });

    // The oracle: a model built from nothing with the same weight version.
    agreed(fmt::format("iteration {}: the freshly built model", it), [&] {
      auto t = clock_type::now();
      auto compute = fusion::make_compute(driver, device);
      fusion::TinyMoeLM fresh(e.heap, *compute, o.model.model_config(), version, o.model.model_options());
      ref = generate(fresh);
      row["fresh_model_s"] = since(t);
    });
    Comparison c = compare_outputs(ref, out, o.model.prompts);
    Comparison changed = compare_outputs(previous, out, o.model.prompts);
    row["matching"] = c.matching_prompts;
    row["prompts"] = o.model.prompts;
    row["mismatched_tokens"] = c.mismatched_tokens;
    row["tokens_changed_by_update"] = changed.mismatched_tokens;
    row["digest"] = digest(out);
    previous = out;
    result["iterations"].push_back(row);
  }
  progress.done();
  return result;
}

// The flags checked once here, naming the flag's text, rather than in every rank; then the
// launch of the ranks with the worker's flags.
LaunchOptions rl_launch_options(RlOptions& o) {
  const Backend backend = parse_backend(o.backend);
  if (o.ranks == 0) o.ranks = default_ranks(backend);
  (void)parse_size(o.train_cap);
  // Written so that NaN fails too (De Morgan's form would let it through).
  if (!(o.update_scale > 0 && o.update_scale <= 1000))  // NOLINT(readability-simplify-boolean-expr)
    throw invalid_argument(fmt::format("--update-scale {}: use a number in (0, 1000]", o.update_scale));
  if (!(o.train_fraction >= 0.9 && o.train_fraction <= 1.0))  // NOLINT(readability-simplify-boolean-expr): NaN
    throw invalid_argument(fmt::format("--train-fraction {}: must be in [0.9, 1]", o.train_fraction));
  LaunchOptions lo = model_launch(backend, o.ranks, o.processes, o.group_timeout.value, o.model.wait_timeout_ms);
  lo.worker_args = {"rl-loop",          "--worker",
                    "--backend",        o.backend,
                    "--ranks",          std::to_string(o.ranks),
                    "--iterations",     std::to_string(o.iterations),
                    "--update-seed",    std::to_string(o.update_seed),
                    "--update-scale",   fmt::format("{}", o.update_scale),
                    "--train-fraction", fmt::format("{}", o.train_fraction),
                    "--train-cap",      o.train_cap};
  auto t = o.group_timeout.worker_args();
  lo.worker_args.insert(lo.worker_args.end(), t.begin(), t.end());
  if (!o.progress) lo.worker_args.emplace_back("--no-progress");
  auto m = o.model.args();
  lo.worker_args.insert(lo.worker_args.end(), m.begin(), m.end());
  return lo;
}

// Prints one rank's iteration rows and adds what fails in them to `problems`.
void print_rank_rows(const RankOutcome& out, const nlohmann::json& pr, std::vector<std::string>& problems) {
  if (!pr.contains("iterations")) return;
  for (const auto& row : pr["iterations"]) {
    const int matching = row.value("matching", 0), prompts = row.value("prompts", 0);
    const double share = row.value("train_fraction", 0.0);
    fmt::print("{:>4} {:>4} {:>8.3f} {:>10} {:>10} {:>5.1f}% {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} "
               "{:>7} {:>8}\n",
               out.rank, row.value("iteration", 0), row.value("sleep_s", 0.0),
               format_bytes(row.value("returned", std::size_t{0})),
               format_bytes(row.value("train_bytes", std::size_t{0})), share * 100, row.value("train_s", 0.0),
               row.value("wake_weights_s", 0.0), row.value("load_s", 0.0), row.value("wake_kv_s", 0.0),
               row.value("generate_s", 0.0), row.value("fresh_model_s", 0.0), fmt::format("{}/{}", matching, prompts),
               row.value("tokens_changed_by_update", std::size_t{0}));
    if (matching != prompts)
      problems.push_back(fmt::format("rank {} iteration {}: {}/{} prompts match the freshly built model ({} tokens "
                                     "differ)",
                                     out.rank, row.value("iteration", 0), matching, prompts,
                                     row.value("mismatched_tokens", std::size_t{0})));
    if (share < 0.9 && !row.value("train_capped", false))
      problems.push_back(fmt::format("rank {} iteration {}: the training phase took {:.1f}% of the returned memory "
                                     "(at least 90% required)",
                                     out.rank, row.value("iteration", 0), share * 100));
  }
}

// Prints the table of every rank's iterations; returns every rank's JSON row.
nlohmann::json print_ranks(const LaunchResult& r, std::vector<std::string>& problems) {
  nlohmann::json all = nlohmann::json::array();
  fmt::print("{:>4} {:>4} {:>8} {:>10} {:>10} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>8}\n", "rank", "iter",
             "sleep s", "returned", "trained", "share", "train s", "wake w s", "load s", "wake kv", "gen s", "fresh s",
             "match", "changed");
  for (const RankOutcome& out : r.ranks) {
    nlohmann::json pr = out.result.is_object() ? out.result : nlohmann::json::object();
    pr["rank"] = out.rank;
    pr["ok"] = out.ok;
    if (!out.ok) {
      pr["error"] = out.error;
      problems.push_back(fmt::format("rank {}: {}", out.rank, out.error));
    }
    print_rank_rows(out, pr, problems);
    all.push_back(pr);
  }
  return all;
}

int rl_main(RlOptions o) {
  LaunchOptions lo = rl_launch_options(o);
  LaunchResult r = launch(lo, [&o](Driver& d, Group& g, int dev) { return rl_rank(o, d, g, dev); });

  std::vector<std::string> problems;
  nlohmann::json all = print_ranks(r, problems);
  if (static_cast<int>(r.ranks.size()) != o.ranks) problems.emplace_back("not every rank reported");
  fmt::print("(returned: device memory given back by sleep(2), by cuMemGetInfo; trained: taken outside the pool by the "
             "training phase{}; changed: tokens that differ from the previous iteration's output)\n",
             r.host_memory ? fmt::format(", capped at {} on the host backend", o.train_cap) : "");
  const bool pass = problems.empty();
  if (pass)
    fmt::print("PASS: {} iterations on {} ranks; after every weight update the outputs equal a freshly built model's, "
               "token for token\n",
               o.iterations, o.ranks);
  else {
    fmt::print("FAIL:\n");
    for (const auto& p : problems) fmt::print("  {}\n", p);
  }
  bool written = true;
  if (!o.json.empty())
    written = write_json_file(o.json,
                              nlohmann::json{{"backend", r.backend},
                                             {"ranks", all},
                                             {"processes", o.processes},
                                             {"pass", pass},
                                             {"problems", problems}},
                              "rl-loop");
  std::fflush(stdout);
  if (r.abandoned) {
    fmt::print(stderr, "torpor rl-loop: exiting with rank threads still running\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  return pass && written ? 0 : 1;
}

}  // namespace

int run_rl_loop(const RlOptions& o) {
  if (!o.worker) return rl_main(o);
  GroupOptions go;
  go.timeout = o.group_timeout.value;
  return run_worker(parse_backend(o.backend), go, [&o](Driver& d, Group& g, int dev) { return rl_rank(o, d, g, dev); });
}

}  // namespace torpor::cli
