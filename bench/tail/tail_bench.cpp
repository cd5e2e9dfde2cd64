// torpor_bench_tail: the fused MoE tail against the unfused path it replaces, on two GPUs (one
// process each, the vLLM layout), everything in CUDA graphs:
//   fused     one kernel per call (finalize + Lamport all-reduce + residual + RMSNorm), launched
//             as a programmatic dependent of the call before it (the default);
//   fused-so  the same kernel in plain stream order (TailOptions::programmatic_launch = false);
//   unfused   finalize kernel, ncclAllReduce (fp32), residual + RMSNorm kernel;
//   nccl      ncclAllReduce of the same bf16 bytes alone, for scale.
// The floors under them, in the same run: the one-way latency of a store seen by the peer (one
// thread per GPU bouncing a counter), the per-call cost of an empty kernel in a graph, in
// stream order and as a programmatic dependent, and for every token count the Lamport exchange
// alone with, optionally, parts of the fused kernel's other work (--floor-features).
// --blocks-per-row times the fused tail again with other row decompositions
// (TailOptions::blocks_per_row); --trace adds per-phase and per-block times (TailTrace).
// Each graph holds --calls-per-graph calls; a measurement replays it --replays times between two
// events, after a barrier so both ranks start together; per-call time = elapsed / calls (the
// larger of the two ranks is reported). The link is measured in the same run: SM stores into the
// peer's memory through torpor's peer mapping (the fused kernel's path), one direction alone and
// both at once. Bytes moved per call and rank: the partial sent to each peer, tokens * hidden * 2
// * (ranks - 1).
//
// Targets (issue 5): fused >= 2x faster than unfused for <= 32 tokens, <= 6 us at 8 tokens.
// Prints a table and writes --json. Needs two GPUs with peer access; prints SKIP otherwise.
#include "tail/tail_bench.hpp"

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <memory>

#include "support/processes.hpp"
#include "torpor/backend.hpp"
#include "torpor/kernels/native_stream.hpp"

namespace torpor::bench::tail {

using namespace torpor;
using json = nlohmann::json;

namespace {

// The bench's driver: the cuda backend (it times device kernels), or nothing and a SKIP line.
std::shared_ptr<Driver> open_bench_driver(int r) {
  std::shared_ptr<Driver> driver;
  try {
    driver = open_driver(Backend::cuda).driver;
  } catch (const std::exception& e) {
    if (r == 0) fmt::print("SKIP: tail bench: no usable GPU: {}\n", e.what());
    return nullptr;
  }
  if (driver->device_count() < 2 || !driver->can_access_peer(0, 1)) {
    if (r == 0) fmt::print("SKIP: tail bench: needs two GPUs with peer access ({} found)\n", driver->device_count());
    return nullptr;
  }
  return driver;
}

void rank_main(int r, const Rendezvous& rv, const Options& o) {
  std::shared_ptr<Driver> driver = open_bench_driver(r);
  if (!driver) return;
  cuda(cudaSetDevice(r), "cudaSetDevice");
  cudaStream_t s = nullptr;
  cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  GroupOptions go;
  go.timeout = std::chrono::seconds(120);
  UnixSocketGroup group(rv, r, ranks, go);
  PoolOptions po;
  po.device = r;
  po.exportable = true;
  Pool pool(*driver, po);
  SymmetricHeap heap(pool, group);
  const int max_tokens = *std::max_element(o.tokens.begin(), o.tokens.end());

  // The link, in this run.
  const std::size_t link_bytes = std::size_t{256} << 20;
  SymmetricBuffer& link = heap.allocate(link_bytes, {"bench", "bench.link", false});
  void* src = pool.allocate(link_bytes, {"bench", MemoryClass::cache, "bench.link.src"});
  cuda(cudaMemset(src, 0x3C, link_bytes), "memset");
  cuda(cudaDeviceSynchronize(), "memset");  // the legacy stream is not ordered with ours
  const LinkFigures f = measure_link(group, s, link, src, link_bytes, r, o);

  // The tails and their tensors.
  fusion::TailShape shape;
  shape.hidden = o.hidden;
  shape.max_tokens = max_tokens;
  shape.top_k = o.top_k;
  shape.shared_expert = true;
  Tails tails = make_tails(heap, pool, shape, o);
  NcclComm nccl(group, r);
  const Tensors x = make_tensors(pool, o, r, max_tokens);

  json rows = json::array();
  const Stream ts = kernels::from_native(s, r);
  if (r == 0) print_header(o, *tails.fused, f);
  const RowContext c{group, s, link, x, o, r, max_tokens};
  for (int t : o.tokens) rows.push_back(measure_row(c, tails, nccl, ts, t, f.one_way));
  if (r == 0) report(o, *tails.fused, f, rows);
  std::fflush(stdout);
  group.barrier();
  for (void* p : x.all()) pool.deallocate(p);
  pool.deallocate(src);
  tails.traced.reset();
  tails.by_blocks.clear();
  if (tails.trace != nullptr) pool.deallocate(tails.trace);
  cuda(cudaStreamDestroy(s), "stream destroy");
}

}  // namespace

}  // namespace torpor::bench::tail

int main(int argc, char** argv) {
  using namespace torpor;
  using torpor::bench::tail::ranks;
  torpor::bench::tail::Options o;
  CLI::App app{"torpor_bench_tail: the fused MoE tail against the unfused path on two GPUs"};
  app.add_option("--hidden", o.hidden, "hidden size");
  app.add_option("--top-k", o.top_k, "experts per token");
  app.add_option("--tokens", o.tokens, "token counts");
  app.add_option("--calls-per-graph", o.calls_per_graph, "calls captured in one graph");
  app.add_option("--replays", o.replays, "graph replays per measurement");
  app.add_option("--json", o.json_path, "write the results here");
  app.add_option("--blocks-per-row", o.blocks_per_row,
                 "also time the fused tail with each of these blocks per row (1, 4, 8; TailOptions::blocks_per_row)");
  app.add_option(
      "--floor-features", o.floor_features,
      "Lamport exchange floors to time, as feature masks: 1 the partial's input loads, 2 a copy to itself, "
      "4 the clear's stores, 8 a transposed poll, 16 1024 straight-line FMAs, 64 the "
      "straight-line code run before griddepcontrol.wait too, 128 12 branches over 4 KB of code, 256 the same "
      "over a few bytes");
  app.add_flag("--trace", o.trace, "also time a fused tail that stamps its phases (where a call's time goes)");
  CLI11_PARSE(app, argc, argv);
  // Fork before anything touches CUDA: the parent never does.
  const Rendezvous rv = Rendezvous::create();
  auto outcomes = test::run_ranks(
      ranks, [&](int r) { torpor::bench::tail::rank_main(r, rv, o); }, std::chrono::seconds(540));
  rv.remove();
  const std::string failed = test::failures(outcomes);
  if (!failed.empty()) {
    fmt::print(stderr, "tail bench failed:\n{}", failed);
    return 1;
  }
  return 0;
}
