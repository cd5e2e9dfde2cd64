// One rank's stress plan (stress_plan.hpp). Every rank runs the same steps in the same order
// (sleep and wake are collective through the symmetric heap, generate through the tails), and
// after every generate the ranks exchange their outcome, so a failure on one rank ends the run
// on every rank at the next step instead of leaving the others in a collective wait.
//
// The oracle: each output is held, token for token, against a model built fresh (on the same
// heap, with its own compute stream) from the weight version the engine should hold, which never
// sleeps; and against the first output of that version (first-vs-later agreement). Each level-2
// reload loads the next version (updates + 1), so a parameter that the sleep kept, or that the
// reload skipped, holds the previous version and changes the tokens versus the fresh model. With
// --preserve the version stays (a preserved parameter is kept on purpose: a new version would
// change it). The negative control stale-weights makes exactly that defect: every parameter kept
// by level 2 and skipped by the reload while the version advances; the run must fail.
#include "stress/stress_plan.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include "launch/launch.hpp"
#include "output.hpp"
#include "torpor/error.hpp"

namespace torpor::cli {

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

bool has_tag(const std::vector<std::string>& tags, const std::string& tag) {
  return tags.empty() || std::find(tags.begin(), tags.end(), tag) != tags.end();
}

std::string tags_text(const std::vector<std::string>& tags) {
  if (tags.empty()) return "all";
  std::string s;
  for (const auto& t : tags) s += (s.empty() ? "" : ",") + t;
  return s;
}

// Device memory in use, split: the pool's mapped bytes, CUDA's graph allocator (memory nodes of
// any graph of the process; 0 on the host backend) and the rest (the context, the libraries'
// own allocations, anything else on the device).
nlohmann::json memory_split(std::size_t used, std::size_t mapped, std::size_t graph_allocator) {
  const auto other =
      static_cast<long long>(used) - static_cast<long long>(mapped) - static_cast<long long>(graph_allocator);
  return {{"used", used}, {"torpor_mapped", mapped}, {"graph_allocator", graph_allocator}, {"other", other}};
}

class Plan {
 public:
  Plan(const StressOptions& o, Driver& driver, Group& group, int device, std::size_t context_bytes)
      : o_(o),
        driver_(driver),
        group_(group),
        device_(device),
        rank_(group.rank()),
        context_bytes_(context_bytes),
        progress_(group.rank() == 0 && o.progress),
        version_{o.model.seed, o.model.seed ^ 0x5EEDu, 0, 0.25f},
        engine_(driver, group, device, o.model, parse_fill_on_wake(o.fill), kept_by_level2(o), version_),
        prompts_(fusion::make_prompts(o.model.seed, o.model.prompts, o.model.prompt_len, o.model.config.vocab)) {}

  nlohmann::json run() {
    auto& m = *engine_.model;
    result_ = {{"rank", rank_},
               {"device", device_},
               {"device_name", driver_.device_properties(device_).name},
               {"backend", std::string(driver_.backend_name())},
               {"group", std::string(group_.kind())},
               {"parameter_bytes", m.parameter_bytes()},
               {"context_bytes", context_bytes_}};
    nlohmann::json paths = nlohmann::json::array(), reasons = nlohmann::json::array();
    int fused = 0;
    for (auto p : m.tail_paths()) {
      paths.push_back(fusion::to_string(p));
      fused += p != fusion::TailPath::unfused;
    }
    for (const auto& r : m.tail_reasons()) reasons.push_back(r);
    result_["group_timeout_ms"] = group_.timeout().count();  // what every wait of this rank is bounded by
    result_["tail_paths"] = paths;
    result_["tail_reasons"] = reasons;
    result_["fused_runners"] = fused;
    result_["runners"] = paths.size();
    result_["steps"] = nlohmann::json::array();

    const int total = 5 + o_.cycles;
    int n = 0;
    step(++n, total, "generate", [&](nlohmann::json& row) { (void)row; });
    step(++n, total, "generate again", [&](nlohmann::json&) {});
    step(++n, total, "sleep 1, wake all", [&](nlohmann::json& row) { transition(plan_level1(), row); });
    for (int i = 0; i < 2; ++i) {
      step(++n, total, fmt::format("sleep 2, wake weights, reload, wake kv_cache #{}", i + 1),
           [&](nlohmann::json& row) {
             transition(plan_level2(), row);
             if (i == 0 && o_.negative_control == "zero-flags") zero_tail_state(row);
           });
    }
    const auto& patterns = soak_patterns();
    for (int c = 0; c < o_.cycles; ++c) {
      const SleepPattern& p = patterns[static_cast<std::size_t>(c) % patterns.size()];
      step(++n, total, fmt::format("soak {}: {}", c + 1, p.name), [&](nlohmann::json& row) {
        row["kind"] = "soak";
        row["cycle"] = c + 1;
        transition(p, row);
      });
    }
    progress_.done();
    const auto& s = m.decode_stats();
    result_["graphs"] = {{"captured", s.graphs_captured}, {"replays", s.graph_replays}, {"eager_steps", s.eager_steps}};
    result_["reference_digest"] = digest(reference_);
    if (o_.negative_control == "zero-flags")
      throw rank_failure(fmt::format("negative control: the tail state of rank {} was zeroed and every output still "
                                     "matched: the lost state went unnoticed",
                                     negative_rank()),
                         result_);
    return result_;
  }

 private:
  int negative_rank() const { return o_.negative_rank >= 0 ? o_.negative_rank : group_.size() - 1; }

  // Runs `before` (a transition, or nothing), then a generate, compared with the reference.
  template <typename F>
  void step(int n, int total, const std::string& name, F&& before) {
    progress_.update(fmt::format("[stress] step {}/{}: {}", n, total, name));
    nlohmann::json row = {{"step", name}, {"kind", "plan"}, {"level", 0}};
    std::string failure;
    std::vector<std::int32_t> out;
    try {
      before(row);
      auto t = clock_type::now();
      const auto& m = o_.model;
      out = engine_.model->generate(prompts_, m.prompts, m.prompt_len, m.new_tokens);
      row["generate_s"] = since(t);
      t = clock_type::now();
      fresh_model_output();
      row["fresh_model_s"] = since(t);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (zeroed_at_) row["seconds_since_zeroing"] = since(*zeroed_at_);
    try {
      agree_on_failures(group_, fmt::format("step '{}'", name), failure);
    } catch (const std::exception& e) {
      row["error"] = e.what();
      result_["steps"].push_back(row);
      result_["failed_step"] = name;
      if (zeroed_at_) {
        result_["negative_control"] = {{"rank", negative_rank()},
                                       {"seconds_to_failure", since(*zeroed_at_)},
                                       {"wait_timeout_ms", o_.model.wait_timeout_ms}};
      }
      progress_.done();
      throw rank_failure(e.what(), result_);
    }
    if (reference_.empty()) reference_ = out;
    auto first = first_of_version_.try_emplace(version_.updates, out).first;
    const Comparison fresh = compare_outputs(fresh_of_version_.at(version_.updates), out, o_.model.prompts);
    const Comparison c = compare_outputs(first->second, out, o_.model.prompts);
    row["weight_version"] = version_.updates;
    row["matching_fresh_model"] = fresh.matching_prompts;
    row["matching_first_output"] = c.matching_prompts;
    row["matching"] = std::min(fresh.matching_prompts, c.matching_prompts);
    row["prompts"] = o_.model.prompts;
    row["mismatched_tokens"] = std::max(fresh.mismatched_tokens, c.mismatched_tokens);
    row["digest"] = digest(out);
    measure(row);
    result_["steps"].push_back(row);
  }

  // The level-2 keep list the engine is built with: --preserve, or every parameter for the
  // negative control stale-weights.
  static std::vector<std::string> kept_by_level2(const StressOptions& o) {
    return o.negative_control == "stale-weights" ? std::vector<std::string>{"*"} : o.preserve;
  }
  // Whether each level-2 reload loads the next weight version (see the file's note).
  bool versions_advance() const { return o_.preserve.empty(); }

  // The oracle's output for the current weight version: a model built from nothing (collective,
  // like every step), generated once per version, then freed.
  void fresh_model_output() {
    if (fresh_of_version_.count(version_.updates) != 0) return;
    auto compute = fusion::make_compute(driver_, device_);
    fusion::TinyMoeLM fresh(engine_.heap, *compute, o_.model.model_config(), version_, o_.model.model_options());
    const auto& m = o_.model;
    fresh_of_version_[version_.updates] = fresh.generate(prompts_, m.prompts, m.prompt_len, m.new_tokens);
  }

  void measure(nlohmann::json& row) {
    PoolStats st = engine_.pool.stats();
    row["mapped"] = st.mapped_bytes;
    row["host_store"] = st.host_store_bytes;
    const MemoryInfo mi = driver_.memory_info(device_);
    row["device_free"] = mi.free_bytes;
    row["device_used"] = mi.total_bytes - mi.free_bytes;  // cuMemGetInfo: every user of the device
    if (driver_.capabilities().physical_accounting)
      row["live_physical"] = driver_.live_physical_bytes(device_);
    else
      row["live_physical"] = nullptr;
  }

  // Device memory in use now, split (memory_split).
  nlohmann::json memory_now() {
    const MemoryInfo mi = driver_.memory_info(device_);
    return memory_split(mi.total_bytes - mi.free_bytes, engine_.pool.stats().mapped_bytes,
                        engine_.compute->graph_allocator_bytes().reserved);
  }

  void transition(const SleepPattern& p, nlohmann::json& row) {
    row["pattern"] = p.name;
    row["level"] = p.level;
    row["sleep_tags"] = tags_text(p.sleep_tags);
    nlohmann::json memory = {{"awake", memory_now()}};
    const std::size_t free_before = driver_.memory_info(device_).free_bytes;
    auto t = clock_type::now();
    TransitionReport sr = engine_.pool.sleep(p.level, p.sleep_tags);
    row["sleep_s"] = since(t);
    const std::size_t free_asleep = driver_.memory_info(device_).free_bytes;
    memory["asleep"] = memory_now();
    // What stayed on the device while asleep that is neither the pool's (mapped: the tags still
    // awake) nor there before the rank made its pool and model: a leak outside the pool shows here.
    row["outside_torpor"] = memory["asleep"]["used"].get<long long>() -
                            memory["asleep"]["torpor_mapped"].get<long long>() - static_cast<long long>(context_bytes_);
    row["graph_allocator_asleep"] = memory["asleep"]["graph_allocator"];
    row["offloaded"] = sr.bytes_offloaded;
    row["skipped"] = sr.bytes_skipped;
    row["discarded"] = sr.bytes_discarded;
    row["released"] = sr.bytes_released;
    row["returned"] = free_asleep > free_before ? free_asleep - free_before : 0;
    const bool reload = p.level == 2 && has_tag(p.sleep_tags, tags::weights);
    bool reloaded = false;
    double wake_s = 0;
    std::size_t restored = 0;
    for (const auto& woken : p.wakes) {
      auto tw = clock_type::now();
      TransitionReport wr = engine_.pool.wake_up(woken);
      wake_s += since(tw);
      restored += wr.bytes_restored;
      if (reload && !reloaded && has_tag(woken, tags::weights)) {
        if (versions_advance()) ++version_.updates;
        fusion::LoadReport lr = engine_.model->load_weights(version_, kept_by_level2(o_));
        row["loaded_version"] = version_.updates;
        row["reload_s"] = lr.seconds;
        row["reloaded_bytes"] = lr.bytes_loaded;
        row["preserved_bytes"] = lr.bytes_skipped;
        reloaded = true;
      }
    }
    row["wake_s"] = wake_s;
    row["restored"] = restored;
    memory["woken"] = memory_now();
    row["memory"] = memory;
    row["wakes"] = [&] {
      std::string s;
      for (const auto& tags : p.wakes) s += (s.empty() ? "" : " then ") + tags_text(tags);
      return s;
    }();
  }

  // The negative control: zero the tail's slots and control blocks on one rank, with nothing in
  // flight, after the first level-2 wake. The next generate must fail, naming the rank and op.
  void zero_tail_state(nlohmann::json& row) {
    auto states = engine_.model->tail_states();
    if (states.empty())
      throw error(
          fmt::format("negative control zero-flags: the tails took the unfused path ({}), which keeps no device "
                      "state to zero; it needs the fused path",
                      engine_.model->tail_reasons().front()));
    const int target = negative_rank();
    group_.barrier();
    std::size_t zeroed = 0;
    if (rank_ == target) {
      Stream s = engine_.compute->stream();
      for (const fusion::TailState& t : states) {
        driver_.fill_async(reinterpret_cast<device_ptr>(t.control), 0, t.control_bytes, s);
        driver_.fill_async(reinterpret_cast<device_ptr>(t.slots->local()), 0, t.slot_bytes, s);
        zeroed += t.control_bytes + t.slot_bytes;
      }
      engine_.compute->synchronize();
    }
    group_.barrier();
    zeroed_at_ = clock_type::now();
    row["negative_control"] = {{"zeroed_rank", target}, {"zeroed_bytes", zeroed}, {"tails", states.size()}};
  }

  const StressOptions& o_;
  Driver& driver_;
  Group& group_;
  int device_;
  int rank_;
  std::size_t context_bytes_;  // device memory in use before the pool and the model existed
  Progress progress_;
  fusion::WeightVersion version_;  // what the engine's parameters should hold
  RankEngine engine_;
  std::vector<std::int32_t> prompts_;
  std::vector<std::int32_t> reference_;
  std::map<int, std::vector<std::int32_t>> first_of_version_, fresh_of_version_;  // by version_.updates
  std::optional<clock_type::time_point> zeroed_at_;
  nlohmann::json result_;
};

}  // namespace

SleepPattern plan_level1() { return {"sleep 1, wake all", 1, {}, {{}}}; }
SleepPattern plan_level2() {
  return {"sleep 2, wake weights, reload, wake kv_cache", 2, {}, {{tags::weights}, {tags::kv_cache}}};
}

const std::vector<SleepPattern>& soak_patterns() {
  static const std::vector<SleepPattern> patterns = {
      {"L1 all, wake all", 1, {}, {{}}},
      {"L2 all, wake weights + reload, wake kv_cache", 2, {}, {{tags::weights}, {tags::kv_cache}}},
      {"L1 kv_cache only, wake kv_cache", 1, {tags::kv_cache}, {{tags::kv_cache}}},
      {"L2 all, wake kv_cache, wake weights + reload", 2, {}, {{tags::kv_cache}, {tags::weights}}},
      {"L1 all, wake weights, wake kv_cache", 1, {}, {{tags::weights}, {tags::kv_cache}}},
      {"L2 weights only, wake weights + reload", 2, {tags::weights}, {{tags::weights}}},
  };
  return patterns;
}

nlohmann::json stress_rank(const StressOptions& options, Driver& driver, Group& group, int device) {
  // The baseline: the device's memory in use once this rank's context exists (memory_info binds
  // the device's primary context), before its pool, compute and model do.
  const MemoryInfo mi = driver.memory_info(device);
  Plan plan(options, driver, group, device, mi.total_bytes - mi.free_bytes);
  return plan.run();
}

}  // namespace torpor::cli
