// Aggregation and rendering for `torpor stress` (stress_report.hpp).
#include "stress/stress_report.hpp"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <optional>

#include "torpor/backend.hpp"

namespace torpor::cli {

namespace {

std::size_t num(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<std::size_t>() : 0;
}
double sec(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

// A row's number under `key`, if it has one. Rows are read through find, never a const
// operator[]: a step that failed half-way (a rank's partial result) lacks the keys written after
// the failure, and nlohmann's const operator[] on a missing key is undefined behaviour.
std::optional<std::size_t> number_at(const nlohmann::json& row, const char* key) {
  auto it = row.find(key);
  if (it == row.end() || !it->is_number()) return std::nullopt;
  return it->get<std::size_t>();
}

// Growth of one metric over the soak rows of one rank, after the warm-up; "" when none. A row
// without the metric (a failed step) ends the series: the failure is reported on its own.
std::string growth(const std::vector<nlohmann::json>& soak, std::size_t warmup, const char* key, const char* what,
                   int rank, nlohmann::json& out) {
  if (soak.size() <= warmup) return "";
  std::size_t base = 0, worst = 0, lo = SIZE_MAX, hi = 0;
  int worst_cycle = 0;
  for (std::size_t i = 0; i < soak.size(); ++i) {
    const std::optional<std::size_t> v = number_at(soak[i], key);
    if (!v) {
      if (i <= warmup) return "";
      break;
    }
    const std::size_t x = *v;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    if (i < warmup) {
      base = std::max(base, x);
    } else if (x > worst) {
      worst = x;
      worst_cycle = soak[i].value("cycle", 0);
    }
  }
  out[key] = {{"min", lo}, {"max", hi}, {"after_warmup_max", worst}, {"warmup_max", base}};
  if (worst <= base) return "";
  return fmt::format("soak: rank {}: {} grew from {} (max over the first {} cycles) to {} at cycle {}", rank, what,
                     base, warmup, worst, worst_cycle);
}

std::string signed_bytes(long long b) {
  return b < 0 ? "-" + format_bytes(static_cast<std::size_t>(-b)) : format_bytes(static_cast<std::size_t>(b));
}

long long signed_num(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<long long>() : 0;
}

// "1.2 GiB = 1.0 GiB + 0 B + 200 MiB" of a memory_split (stress_plan.cpp).
std::string split_text(const nlohmann::json& m) {
  return fmt::format("{} = {} + {} + {}", format_bytes(m.value("used", std::size_t{0})),
                     format_bytes(m.value("torpor_mapped", std::size_t{0})),
                     format_bytes(m.value("graph_allocator", std::size_t{0})), signed_bytes(signed_num(m, "other")));
}

// A rank's device memory, from its transition rows: the split awake / asleep / after wake of the
// first transition of each level, and the range of what stayed outside the pool while asleep.
nlohmann::json rank_memory(const nlohmann::json& pr, const std::vector<nlohmann::json>& transitions) {
  nlohmann::json m = {{"context_bytes", pr.value("context_bytes", std::size_t{0})}};
  long long lo = 0, hi = 0;
  std::size_t graph_allocator = 0;
  bool any = false;
  nlohmann::json firsts = nlohmann::json::array();
  std::vector<int> levels_seen;
  for (const auto& row : transitions) {
    if (!row.contains("outside_torpor")) continue;
    const long long out = signed_num(row, "outside_torpor");
    lo = any ? std::min(lo, out) : out;
    hi = any ? std::max(hi, out) : out;
    any = true;
    graph_allocator = std::max(graph_allocator, row.value("graph_allocator_asleep", std::size_t{0}));
    const int level = row.value("level", 0);
    if (row.contains("memory") && std::find(levels_seen.begin(), levels_seen.end(), level) == levels_seen.end()) {
      levels_seen.push_back(level);
      nlohmann::json f = row["memory"];
      f["step"] = row.value("step", "");
      f["level"] = level;
      f["outside_torpor"] = out;
      firsts.push_back(f);
    }
  }
  if (!any) return nlohmann::json();
  m["outside_torpor_asleep"] = {{"min", lo}, {"max", hi}};
  m["graph_allocator_asleep_max"] = graph_allocator;
  m["transitions"] = firsts;
  return m;
}

// A step's aggregate over the ranks before any rank's row is added.
nlohmann::json empty_step(const nlohmann::json& row) {
  return {{"step", row.value("step", "")},
          {"level", 0},
          {"ranks", 0},
          {"offloaded", 0},
          {"skipped", 0},
          {"discarded", 0},
          {"released", 0},
          {"returned", 0},
          {"outside_torpor", 0},
          {"restored", 0},
          {"sleep_s", 0.0},
          {"wake_s", 0.0},
          {"reload_s", 0.0},
          {"generate_s", 0.0},
          {"matching", -1},
          {"prompts", 0},
          {"mismatched_tokens", 0},
          {"kind", row.value("kind", "plan")}};
}

// Adds one rank's row to its step's aggregate (bytes summed, seconds max, matching min); an
// output that differs from the reference is a problem.
void add_step_row(nlohmann::json& a, const nlohmann::json& row, int rank, std::vector<std::string>& problems) {
  a["ranks"] = a["ranks"].get<int>() + 1;
  a["level"] = std::max(a["level"].get<int>(), row.value("level", 0));
  for (const char* k : {"offloaded", "skipped", "discarded", "released", "returned", "restored", "mismatched_tokens"})
    a[k] = a[k].get<std::size_t>() + num(row, k);
  for (const char* k : {"sleep_s", "wake_s", "reload_s", "generate_s"})
    a[k] = std::max(a[k].get<double>(), sec(row, k));
  if (row.contains("matching")) {
    int m = row["matching"].get<int>();
    a["matching"] = a["matching"].get<int>() < 0 ? m : std::min(a["matching"].get<int>(), m);
    a["prompts"] = row.value("prompts", 0);
    if (m < row.value("prompts", 0))
      problems.push_back(
          fmt::format("step '{}': rank {}: {}/{} prompts match a freshly built model of the weight version "
                      "and that version's first output ({} tokens differ)",
                      row.value("step", ""), rank, m, row.value("prompts", 0), num(row, "mismatched_tokens")));
  }
  if (row.contains("outside_torpor"))
    a["outside_torpor"] = a["outside_torpor"].get<long long>() + signed_num(row, "outside_torpor");
  if (row.contains("error")) a["error"] = row["error"];
}

// One rank's rows: what summarize() gathers from them besides the step aggregates.
struct RankRows {
  std::vector<nlohmann::json> soak, transitions;
};

struct SoakTotals {
  std::size_t rows = 0, mismatched_tokens = 0;
};

RankRows add_rank_steps(const nlohmann::json& pr, int rank, std::vector<nlohmann::json>& steps, SoakTotals& totals,
                        std::vector<std::string>& problems) {
  RankRows rows;
  if (!pr.contains("steps")) return rows;
  for (std::size_t i = 0; i < pr["steps"].size(); ++i) {
    const auto& row = pr["steps"][i];
    if (steps.size() <= i) steps.push_back(empty_step(row));
    add_step_row(steps[i], row, rank, problems);
    if (row.contains("outside_torpor")) rows.transitions.push_back(row);
    if (row.value("kind", "") == "soak") {
      rows.soak.push_back(row);
      ++totals.rows;
      totals.mismatched_tokens += num(row, "mismatched_tokens");
    }
  }
  return rows;
}

// The rank's graphs, its memory while asleep and the growth over the soak: problems, and the
// reported figures in `pr`.
void judge_rank_resources(nlohmann::json& pr, const RankOutcome& r, const RankRows& rows,
                          const StressExpectations& expect, std::vector<std::string>& problems) {
  if (expect.graphs && r.ok && pr.contains("graphs")) {
    const std::size_t captured = pr["graphs"].value("captured", std::size_t{0});
    if (captured != 1)
      problems.push_back(fmt::format("rank {}: {} CUDA graphs captured for one batch size (expected exactly one, "
                                     "replayed before and after every sleep)",
                                     r.rank, captured));
  }
  if (nlohmann::json mem = rank_memory(pr, rows.transitions); !mem.is_null()) {
    // The runner's graphs keep their memory in the pool (capture refuses memory nodes), so
    // CUDA's graph allocator holds nothing: anything there is graph memory outside torpor.
    const std::size_t ga = mem["graph_allocator_asleep_max"].get<std::size_t>();
    if (ga > 0)
      problems.push_back(fmt::format("rank {}: CUDA's graph allocator held {} while asleep: graph memory outside "
                                     "the pool, never released by sleep",
                                     r.rank, format_bytes(ga)));
    pr["memory"] = mem;
  }
  nlohmann::json g;
  const std::size_t warmup = std::min<std::size_t>(static_cast<std::size_t>(expect.cycles), expect.soak_patterns);
  for (auto [key, what] : {std::pair{"live_physical", "live physical bytes"}, std::pair{"host_store", "the host store"},
                           std::pair{"mapped", "mapped bytes"}})
    if (std::string p = growth(rows.soak, warmup, key, what, r.rank, g); !p.empty()) problems.push_back(p);
  // Device memory in use after each cycle (cuMemGetInfo): reported, not judged, since on a GPU it
  // includes every other user of the device; live physical bytes and mapped bytes are judged.
  std::size_t lo = SIZE_MAX, hi = 0;
  for (const auto& row : rows.soak)
    if (const std::optional<std::size_t> used = number_at(row, "device_used")) {
      lo = std::min(lo, *used);
      hi = std::max(hi, *used);
    }
  if (lo <= hi) g["device_used"] = {{"min", lo}, {"max", hi}};
  if (!g.empty()) pr["soak_growth"] = g;
}

// The problems of the run as a whole: failed ranks first (the same text from several ranks said
// once), ranks that decoded different tokens, ranks that did not report.
void add_run_problems(const std::map<std::string, std::vector<int>>& errors,
                      const std::map<std::string, std::vector<int>>& digests, std::size_t reported, int expected,
                      std::vector<std::string>& problems) {
  for (const auto& [text, ranks] : errors)
    problems.insert(problems.begin(),
                    fmt::format("{} {}: {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ","), text));
  if (digests.size() > 1) {
    std::string text;
    for (const auto& [d, ranks] : digests)
      text += fmt::format("{}{} on ranks {}", text.empty() ? "" : ", ", d, fmt::join(ranks, ","));
    problems.push_back("the ranks decoded different tokens (reference digests: " + text + ")");
  }
  if (static_cast<int>(reported) != expected)
    problems.push_back(fmt::format("{} ranks reported, {} expected", reported, expected));
}

}  // namespace

StressSummary summarize(const LaunchResult& launch, const StressExpectations& expect) {
  StressSummary s;
  nlohmann::json& j = s.json;
  j["backend"] = launch.backend;
  j["ranks"] = launch.ranks.size();
  j["cycles"] = expect.cycles;
  j["per_rank"] = nlohmann::json::array();
  std::vector<nlohmann::json> steps;
  std::map<std::string, std::vector<int>> digests;
  SoakTotals soak;
  std::map<std::string, std::vector<int>> errors;  // the same text from several ranks is said once

  for (const RankOutcome& r : launch.ranks) {
    nlohmann::json pr = r.result.is_object() ? r.result : nlohmann::json::object();
    pr["rank"] = r.rank;
    pr["ok"] = r.ok;
    if (!r.ok) {
      pr["error"] = r.error;
      errors[r.error].push_back(r.rank);
    }
    if (pr.contains("reference_digest")) digests[pr["reference_digest"].get<std::string>()].push_back(r.rank);
    const RankRows rows = add_rank_steps(pr, r.rank, steps, soak, s.problems);
    judge_rank_resources(pr, r, rows, expect, s.problems);
    j["per_rank"].push_back(pr);
  }
  add_run_problems(errors, digests, launch.ranks.size(), expect.ranks, s.problems);
  if (expect.cycles > 0) {
    j["soak"] = {{"cycles", expect.cycles}, {"rows", soak.rows}, {"mismatched_tokens", soak.mismatched_tokens}};
  }
  j["steps"] = steps;
  if (expect.negative_control) {
    // The run must fail: its success would mean the zeroed state went unnoticed.
    if (s.problems.empty()) s.problems.emplace_back("negative control: the run reported no failure");
    for (const auto& pr : j["per_rank"])
      if (pr.contains("negative_control")) {
        j["negative_control"] = pr["negative_control"];
        break;
      }
  }
  s.pass = s.problems.empty() && !expect.negative_control;
  j["pass"] = s.pass;
  j["problems"] = s.problems;
  return s;
}

std::string render(const StressSummary& s) {
  const auto& j = s.json;
  std::string out;
  out += fmt::format("{:<52} {:>5} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>7}\n", "step", "level", "offloaded",
                     "discarded", "returned", "outside", "sleep s", "wake s", "match");
  for (const auto& a : j["steps"]) {
    const int level = a["level"].get<int>();
    const int m = a["matching"].get<int>();
    std::string match =
        a.contains("error") ? "ERROR" : (m < 0 ? "-" : fmt::format("{}/{}", m, a["prompts"].get<int>()));
    if (level == 0)
      out += fmt::format("{:<52} {:>5} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>7}\n", a["step"].get<std::string>(),
                         "-", "-", "-", "-", "-", "-", "-", match);
    else
      out +=
          fmt::format("{:<52} {:>5} {:>10} {:>10} {:>10} {:>10} {:>8.3f} {:>8.3f} {:>7}\n",
                      a["step"].get<std::string>(), level,
                      format_bytes(a["offloaded"].get<std::size_t>() + a["skipped"].get<std::size_t>()),
                      format_bytes(a["discarded"].get<std::size_t>()), format_bytes(a["returned"].get<std::size_t>()),
                      signed_bytes(a["outside_torpor"].get<long long>()), a["sleep_s"].get<double>(),
                      a["wake_s"].get<double>(), match);
  }
  out += "(bytes summed over the ranks; offloaded: backed up in the host store, copied now or unchanged since the last "
         "copy; returned: device memory given back while asleep, by cuMemGetInfo; outside: in use while asleep outside "
         "the pool, beyond the rank's context; seconds: the slowest rank)\n";
  for (const auto& pr : j["per_rank"]) {
    if (!pr.contains("tail_paths")) continue;
    std::string paths;
    for (const auto& p : pr["tail_paths"]) paths += (paths.empty() ? "" : ", ") + p.get<std::string>();
    std::string reason = pr["tail_reasons"].empty() ? "" : pr["tail_reasons"][0].get<std::string>();
    out += fmt::format("rank {} ({} {}): {}/{} runners fused [{}]{}\n", pr["rank"].get<int>(), pr.value("backend", ""),
                       pr.value("device_name", ""), pr.value("fused_runners", 0), pr.value("runners", 0), paths,
                       reason.empty() ? "" : " — " + reason);
    if (pr.contains("graphs") && pr["graphs"].value("captured", 0) > 0)
      out += fmt::format("rank {}: CUDA graphs: {} captured, {} replays, {} eager steps\n", pr["rank"].get<int>(),
                         pr["graphs"]["captured"].get<std::size_t>(), pr["graphs"]["replays"].get<std::size_t>(),
                         pr["graphs"]["eager_steps"].get<std::size_t>());
    if (pr.contains("memory")) {
      const auto& m = pr["memory"];
      out += fmt::format("rank {}: device memory in use = torpor mapped + CUDA graph allocator + other (context {}):\n",
                         pr["rank"].get<int>(), format_bytes(m["context_bytes"].get<std::size_t>()));
      for (const auto& t : m["transitions"])
        out += fmt::format("  {}: awake {}; asleep {}; after wake {}; outside torpor while asleep {}\n",
                           t.value("step", ""), split_text(t["awake"]), split_text(t["asleep"]), split_text(t["woken"]),
                           signed_bytes(t["outside_torpor"].get<long long>()));
      out += fmt::format("  outside torpor while asleep, every transition: {}..{}\n",
                         signed_bytes(m["outside_torpor_asleep"]["min"].get<long long>()),
                         signed_bytes(m["outside_torpor_asleep"]["max"].get<long long>()));
    }
    if (pr.contains("soak_growth")) {
      const auto& g = pr["soak_growth"];
      std::string line = fmt::format("rank {}: soak, after each cycle:", pr["rank"].get<int>());
      for (auto [key, what] : {std::pair{"live_physical", "live physical"}, std::pair{"host_store", "host store"},
                               std::pair{"mapped", "mapped"}, std::pair{"device_used", "device in use"}})
        if (g.contains(key))
          line += fmt::format(" {} {}..{}", what, format_bytes(g[key]["min"].get<std::size_t>()),
                              format_bytes(g[key]["max"].get<std::size_t>()));
      out += line + "\n";
    }
  }
  if (j.contains("soak"))
    out += fmt::format("soak: {} cycles, {} tokens differ from the first output\n", j["soak"]["cycles"].get<int>(),
                       j["soak"]["mismatched_tokens"].get<std::size_t>());
  if (j.contains("negative_control")) {
    const auto& n = j["negative_control"];
    out += fmt::format("negative control: the tail state of rank {} was zeroed after the first level-2 wake; the run "
                       "failed {:.2f} s later (wait bound {} ms)\n",
                       n["rank"].get<int>(), n["seconds_to_failure"].get<double>(), n["wait_timeout_ms"].get<int>());
  }
  if (s.pass) {
    out += "every output matches a freshly built model of its weight version (one that never slept)\n";
    out += fmt::format("PASS: every output matches the first, token for token, on every rank ({} ranks)\n",
                       j["ranks"].get<std::size_t>());
  } else {
    out += "FAIL:\n";
    for (const auto& p : s.problems) out += "  " + p + "\n";
  }
  return out;
}

}  // namespace torpor::cli
