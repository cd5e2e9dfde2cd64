// torpor_bench_tail's rows (tail_bench.hpp): every tail timed at one token count, the Lamport
// floors and the traced tail's phases beside them, the table lines, and the closing targets and
// --json. scripts/gpu_run.sh parses what these print: change the format there too.
#include <cuda_runtime.h>
#include <fmt/core.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "tail/tail_bench.hpp"
#include "torpor/consensus.hpp"
#include "torpor/fusion/tail_state.hpp"
#include "torpor/kernels/tail_kernels.hpp"

namespace torpor::bench::tail {

using namespace torpor;
using json = nlohmann::json;

void print_header(const Options& o, const fusion::Tail& fused, const LinkFigures& f) {
  fmt::print(
      "tail fusion bench: 2 GPUs, hidden {}, top_k {} + shared expert, bf16, CUDA graphs of {} calls x {} replays\n",
      o.hidden, o.top_k, o.calls_per_graph, o.replays);
  fmt::print("path: {}\n", fused.reason());
  if (auto st = fusion::tail_state(fused))
    fmt::print("fused grid: {} blocks per row up to {} rows, else {} ({} blocks resident at most)\n",
               st->blocks_per_row_few_rows, kernels::tail_cluster_max_rows, st->blocks_per_row_many_rows,
               st->capacity_blocks);
  fmt::print(
      "link (SM stores to the peer's memory): {:.1f} GB/s one way alone, {:.1f} + {:.1f} GB/s both ways at once\n",
      f.one_way, f.both[0], f.both[1]);
  fmt::print("store seen by the peer (ping-pong): {:.2f} us one way\n", f.latency_us);
  fmt::print("one thread's dependent loads: local {:.0f} ns (.sys), {:.0f} ns (.gpu); the peer's {:.0f} ns (.sys); "
             "globaltimer step {:.0f} ns, "
             "one read {:.0f} ns\n",
             f.sys_local_ns, f.gpu_local_ns, f.sys_peer_ns, f.timer_step_ns, f.timer_read_ns);
  fmt::print("empty kernel ({} blocks) per call in a graph: {:.2f} us in stream order, {:.2f} us as a programmatic "
             "dependent\n",
             f.empty_blocks, f.empty_so_us, f.empty_pdl_us);
  fmt::print("{:>6} {:>10} {:>12} {:>11} {:>10} {:>8} {:>11} {:>10} {:>7}\n", "tokens", "fused us", "fused-so us",
             "unfused us", "nccl us", "speedup", "bytes/rank", "fused GB/s", "% link");
}

namespace {

// The Lamport exchange alone (bench::launch_lamport_floor) for this row count: the floor under
// the fused kernel's send + receive, then with the fused kernel's other work added.
json time_floors(const RowContext& c, int t) {
  const int floor_n = t * (c.o.hidden / 8);
  json floors = json::object();
  std::string floor_line;
  for (int features : c.o.floor_features) {
    // (the loads read 9 vectors per thread from expert_out, which holds top_k * max_tokens rows)
    if ((features & 1) && 9 * t > c.o.top_k * c.max_tokens) continue;
    cuda(cudaMemset(c.link.local(), 0, static_cast<std::size_t>(floor_n) * 16 * 4), "zero the floor buffer");
    cuda(cudaMemset(c.x.floor_calls, 0, static_cast<std::size_t>(floor_n) * 4), "zero the floor counters");
    cuda(cudaDeviceSynchronize(), "zero the floor buffers");
    c.group.barrier();
    const double us = c.time([&] {
      bench::launch_lamport_floor(c.link.local(), c.link.peer(1 - c.r), c.x.floor_calls, c.x.expert, floor_n, features,
                                  c.s);
    });
    floors[std::to_string(features)] = us;
    floor_line += fmt::format("{}{}: {:.2f}", floor_line.empty() ? "" : ", ", features, us);
  }
  if (c.r == 0)
    fmt::print("  {} tokens, Lamport exchange alone (features 1 loads, 2 self copy, 4 clear stores, 8 transposed poll, "
               "16 1024 straight-line FMAs, 64 straight-line code run before the wait too, "
               "128 12 branches over 4 KB of code each, 256 the same over a few bytes): "
               "{} us\n",
               t, floor_line);
  return floors;
}

const char* const trace_phase_names[kernels::tail_trace_phases] = {"waited",     "control read", "partial",
                                                                   "set up",     "sent",         "cleared",
                                                                   "vectors in", "residual",     "row barrier",
                                                                   "block's in", "epilogue",     "end"};

// Per block: the spread of its mean times over the grid (min / median / max, and the slowest
// block), from its own wait's return.
json per_block_spread(const kernels::TailTrace& tr, double n) {
  static const char* bnames[kernels::tail_block_stamps + 1] =
      {"waited after block 0", "partial", "sent", "cleared", "row in", "all sent", "all in", "poll rounds", "end"};
  json per_block = json::object();
  for (int k = -1; k < kernels::tail_block_stamps; ++k) {
    std::vector<std::pair<double, int>> v;
    for (int b = 0; b < kernels::tail_trace_blocks; ++b) {
      if (tr.block_ns[b][kernels::tail_block_stamps - 1] == 0) continue;  // not in the grid
      const double x = k < 0 ? static_cast<double>(tr.block_waited_ns[b]) : static_cast<double>(tr.block_ns[b][k]);
      if (k >= 0 && x == 0) continue;  // a stamp this block does not have
      v.push_back({x / n / 1000.0, b});
    }
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    per_block[bnames[k + 1]] = {{"blocks", v.size()},
                                {"min", v.front().first},
                                {"median", v[v.size() / 2].first},
                                {"max", v.back().first},
                                {"slowest_block", v.back().second}};
  }
  return per_block;
}

// The traced tail's run for this row: this rank's stamps as a JSON row.
json trace_row_of(const RowContext& c, fusion::Tail& traced, kernels::TailTrace* trace, const fusion::TailArgs& a,
                  const Stream& ts) {
  cuda(cudaMemset(trace, 0, sizeof(kernels::TailTrace)), "zero the trace");
  cuda(cudaDeviceSynchronize(), "zero the trace");
  const double t_us = c.time([&] { traced.run(a, ts); });
  traced.check();
  kernels::TailTrace tr{};
  cuda(cudaMemcpy(&tr, trace, sizeof tr, cudaMemcpyDeviceToHost), "read the trace");
  const double n = static_cast<double>(tr.calls);
  std::vector<double> phases;
  for (auto v : tr.phase_ns) phases.push_back(static_cast<double>(v) / n / 1000.0);
  const double gap = tr.gaps ? static_cast<double>(tr.gap_ns) / static_cast<double>(tr.gaps) / 1000.0 : 0.0;
  const double upd = static_cast<double>(tr.updater_ns) / n / 1000.0;
  json named = json::object();
  for (int k = 0; k < kernels::tail_trace_phases; ++k)
    named[trace_phase_names[k]] = phases[static_cast<std::size_t>(k)];
  return {{"rank", c.r},
          {"traced_us", t_us},
          {"calls", tr.calls},
          {"block0_us_from_entry", named},
          {"entry_minus_previous_end_us", gap},
          {"updater_done_us", upd},
          {"sm_ghz", static_cast<double>(tr.cycles) / (phases.back() * 1000.0 * n)},
          {"per_block_us_from_own_wait", per_block_spread(tr, n)}};
}

// Rank 0 prints every rank's trace row.
void print_traces(Group& group, const json& trace_row, int r) {
  const std::string mine = trace_row.dump();
  const auto all = consensus::gather_text(group, mine);
  if (r != 0) return;
  for (const auto& text : all) {
    const json tj = json::parse(text);
    std::string line;
    for (int k = 0; k < kernels::tail_trace_phases; ++k)
      line += fmt::format("{}{} {:.2f}", k ? ", " : "", trace_phase_names[k],
                          tj["block0_us_from_entry"][trace_phase_names[k]].get<double>());
    fmt::print("  trace rank {} ({:.2f} us/call traced), block 0 from entry: {}; entry - previous end {:.2f}; updater "
               "done {:.2f}; SM clock {:.2f} GHz\n",
               tj["rank"].get<int>(), tj["traced_us"].get<double>(), line,
               tj["entry_minus_previous_end_us"].get<double>(), tj["updater_done_us"].get<double>(),
               tj["sm_ghz"].get<double>());
    std::string blocks;
    for (const auto& [name, d] : tj["per_block_us_from_own_wait"].items())
      blocks += fmt::format("{}{} {:.2f}/{:.2f}/{:.2f} (#{})", blocks.empty() ? "" : "; ", name, d["min"].get<double>(),
                            d["median"].get<double>(), d["max"].get<double>(), d["slowest_block"].get<int>());
    fmt::print("    per block (min/median/max over {} blocks, slowest block): {}\n",
               tj["per_block_us_from_own_wait"].contains("end")
                   ? tj["per_block_us_from_own_wait"]["end"]["blocks"].get<int>()
                   : 0,
               blocks);
  }
}

}  // namespace

json measure_row(const RowContext& c, Tails& tails, NcclComm& nccl, const Stream& ts, int t, double one_way) {
  fusion::TailArgs a;
  a.tokens = t;
  a.expert_out = c.x.expert;
  a.topk_weights = c.x.weights;
  a.shared_out = c.x.shared;
  a.residual_in = c.x.residual;
  a.gamma = c.x.gamma;
  a.residual_out = c.x.res_out;
  a.norm_out = c.x.norm_out;
  const double f_us = c.time([&] { tails.fused->run(a, ts); });
  tails.fused->check();
  const double so_us = c.time([&] { tails.fused_so->run(a, ts); });
  tails.fused_so->check();
  const double u_us = c.time([&] { tails.unfused->run(a, ts); });
  tails.unfused->check();
  json floors = time_floors(c, t);
  json by_blocks_row = json::object();
  for (std::size_t i = 0; i < tails.by_blocks.size(); ++i) {
    const double b_us = c.time([&] { tails.by_blocks[i]->run(a, ts); });
    tails.by_blocks[i]->check();
    by_blocks_row[std::to_string(c.o.blocks_per_row[i])] = b_us;
    if (c.r == 0)
      fmt::print("  {} tokens, fused with {} blocks per row: {:.2f} us ({:.2f}x unfused)\n", t, c.o.blocks_per_row[i],
                 b_us, u_us / b_us);
  }
  const double n_us =
      c.time([&] { nccl.all_reduce_sum_bf16(c.x.scratch, static_cast<std::size_t>(t) * c.o.hidden, c.s); });
  json trace_row;
  if (tails.traced) {
    trace_row = trace_row_of(c, *tails.traced, tails.trace, a, ts);
    print_traces(c.group, trace_row, c.r);
  }
  const double bytes = static_cast<double>(t) * c.o.hidden * sizeof(bf16) * (ranks - 1);
  const double gbps = bytes / (f_us * 1e-6) / 1e9;
  if (c.r == 0)
    fmt::print("{:>6} {:>10.2f} {:>12.2f} {:>11.2f} {:>10.2f} {:>7.2f}x {:>11.0f} {:>10.1f} {:>6.1f}%\n", t, f_us,
               so_us, u_us, n_us, u_us / f_us, bytes, gbps, 100.0 * gbps / one_way);
  json row = {{"tokens", t},
              {"fused_us", f_us},
              {"fused_stream_order_us", so_us},
              {"unfused_us", u_us},
              {"nccl_allreduce_us", n_us},
              {"lamport_exchange_us_by_features", floors},
              {"speedup", u_us / f_us},
              {"bytes_per_rank", bytes},
              {"fused_gbps", gbps},
              {"link_fraction", gbps / one_way}};
  if (tails.traced) row["trace_rank0"] = trace_row;
  if (!tails.by_blocks.empty())
    row["fused_us_by_blocks_per_row"] = by_blocks_row;  // (rank 0's own; the table printed both)
  return row;
}

void report(const Options& o, const fusion::Tail& fused, const LinkFigures& f, const json& rows) {
  std::string speedups;
  bool speed_ok = true, latency_ok = true;
  double at8 = -1;
  for (const auto& row : rows) {
    const int t = row["tokens"];
    if (t <= 32) {
      speed_ok = speed_ok && row["speedup"].get<double>() >= 2.0;
      speedups += fmt::format("{}{}: {:.2f}x", speedups.empty() ? "" : ", ", t, row["speedup"].get<double>());
    }
    if (t == 8) {
      at8 = row["fused_us"];
      latency_ok = at8 <= 6.0;
    }
  }
  fmt::print("target >= 2x faster than unfused for <= 32 tokens: {} ({})\n", speed_ok ? "MET" : "MISSED", speedups);
  if (at8 >= 0) fmt::print("target <= 6 us at 8 tokens: {} ({:.2f} us)\n", latency_ok ? "MET" : "MISSED", at8);
  if (o.json_path.empty()) return;
  cudaDeviceProp prop{};
  cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  json j = {{"device", prop.name},
            {"ranks", ranks},
            {"hidden", o.hidden},
            {"top_k", o.top_k},
            {"shared_expert", true},
            {"calls_per_graph", o.calls_per_graph},
            {"replays", o.replays},
            {"path", fused.reason()},
            {"link_gbps_one_way", f.one_way},
            {"link_gbps_both_ways", f.both},
            {"peer_store_latency_us", f.latency_us},
            {"load_latency_ns",
             {{"local_sys", f.sys_local_ns}, {"local_gpu", f.gpu_local_ns}, {"peer_sys", f.sys_peer_ns}}},
            {"globaltimer_step_ns", f.timer_step_ns},
            {"globaltimer_read_ns", f.timer_read_ns},
            {"empty_kernel_blocks", f.empty_blocks},
            {"empty_kernel_us", {{"stream_order", f.empty_so_us}, {"programmatic", f.empty_pdl_us}}},
            {"rows", rows},
            {"target_speedup_met", speed_ok},
            {"target_8_tokens_met", latency_ok}};
  std::ofstream(o.json_path) << j.dump(2) << "\n";
  fmt::print("wrote {}\n", o.json_path);
}

}  // namespace torpor::bench::tail
