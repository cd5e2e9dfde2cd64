// The MoE tail on two GPUs (issue 5): two processes, one GPU each (the vLLM layout), a
// UnixSocketGroup, torpor's CUDA backend. The oracle is the CPU reference of the same protocol
// (the host-backend tail on thread ranks): the GPU must give its bits exactly, and be within bf16
// bounds of the fp64 answer. Every suite skips, saying why, without two GPUs with peer access.
//
// Run by scripts/gpu_run.sh tail (also under compute-sanitizer memcheck and racecheck:
// TailCuda.SanitizerSmoke, one sanitizer per rank, see on_gpus). Children fork before anything
// touches CUDA (the parent never does).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>
#include <tuple>

#include "support/processes.hpp"
#include "tail_oracle.hpp"
#include "tail_support.hpp"
#include "torpor/error.hpp"
#include "torpor/fusion/tail_state.hpp"
#include "torpor/group.hpp"
#include "torpor/symmetric.hpp"

#if defined(TORPOR_KERNELS_CUDA)
#include <cuda_runtime.h>

#include "driver/cuda_driver.hpp"
#include "torpor/kernels/native_stream.hpp"
#include "torpor/kernels/tail_kernels.hpp"
#include "torpor/kernels/tail_reference.hpp"
#endif

namespace torpor::test {
namespace {

using namespace std::chrono_literals;
using fusion::make_tail;
using fusion::Tail;
using fusion::TailOptions;
using fusion::TailPath;

constexpr int ranks = 2;

TailShape gpu_shape(int hidden, TailMode mode = TailMode::all_reduce) {
  TailShape s;
  s.hidden = hidden;
  s.max_tokens = 128;
  s.top_k = 8;
  s.shared_expert = true;
  s.mode = mode;
  return s;
}

// The oracle: each rank's outputs ([tokens][hidden] residual_out, then norm_out) from the CPU
// reference with thread ranks over a HostDriver. Rows a rank does not produce hold 0x7FC1.
std::vector<std::vector<bf16>> oracle(const TailShape& s, const CallInputs& c) {
  HostDriver host(tail_host_options(false));
  auto groups = make_thread_group(ranks);
  std::vector<std::vector<bf16>> out(ranks);
  std::string errors = on_threads(ranks, [&](int r) {
    Pool pool(host, tail_pool_options(r));
    SymmetricHeap heap(pool, *groups[static_cast<std::size_t>(r)]);
    auto tail = make_tail(heap, s);
    if (tail->path() != TailPath::fused_unicast) throw std::runtime_error("oracle path: " + tail->reason());
    RankBuffers b(s, s.max_tokens);
    b.load(c, r);
    b.poison_outputs();
    tail->run(b.args(c.tokens), Stream{});
    const std::size_t n = static_cast<std::size_t>(c.tokens) * s.hidden;
    auto& o = out[static_cast<std::size_t>(r)];
    o.assign(b.residual_out.v.begin(), b.residual_out.v.begin() + static_cast<std::ptrdiff_t>(n));
    o.insert(o.end(), b.norm_out.v.begin(), b.norm_out.v.begin() + static_cast<std::ptrdiff_t>(n));
  });
  if (!errors.empty()) throw std::runtime_error("oracle failed: " + errors);
  return out;
}

// Parent side: skip when a child said so, else no failure allowed.
void expect_ranks(const std::vector<RankOutcome>& outcomes) {
  for (const auto& o : outcomes)
    if (o.exit_code == 0 && o.report.rfind("SKIP: ", 0) == 0) GTEST_SKIP() << o.report.substr(6);
  EXPECT_EQ(failures(outcomes), "");
}

#if defined(TORPOR_KERNELS_CUDA)

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// cudaMemset and pageable cudaMemcpy run on the legacy stream, which is not ordered with the
// tail's non-blocking stream (and a pageable upload may still be in flight when it returns):
// wait for them before the next call.
void settle() { cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

// One rank's GPU world: driver, group, pool, heap, a stream.
struct GpuRank {
  std::unique_ptr<CudaDriver> driver;
  std::unique_ptr<UnixSocketGroup> group;
  std::unique_ptr<Pool> pool;
  std::unique_ptr<SymmetricHeap> heap;
  cudaStream_t stream = nullptr;
  int rank = 0;

  ~GpuRank() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  Stream torpor_stream() const { return kernels::from_native(stream, rank); }
};

// "" when ready; else why not (the child reports "SKIP: why").
std::string open_rank(int r, const Rendezvous& rv, GpuRank& g) {
  std::string why;
  g.driver = CudaDriver::open(&why);
  if (!g.driver) return "no usable GPU: " + why;
  if (g.driver->device_count() < ranks) return "needs two GPUs, found " + std::to_string(g.driver->device_count());
  if (!g.driver->can_access_peer(r, 1 - r)) return "GPUs 0 and 1 cannot access each other";
  g.rank = r;
  cuda(cudaSetDevice(r), "cudaSetDevice");
  cuda(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  GroupOptions go;
  go.timeout = 60s;
  g.group = std::make_unique<UnixSocketGroup>(rv, r, ranks, go);
  PoolOptions po;
  po.device = r;
  po.exportable = true;
  g.pool = std::make_unique<Pool>(*g.driver, po);
  g.heap = std::make_unique<SymmetricHeap>(*g.pool, *g.group);
  return "";
}

// Runs body in one process per GPU; a child that cannot find two GPUs reports a skip.
//
// With TORPOR_RANK and TORPOR_GROUP_RENDEZVOUS set, this process is that one rank of a group
// started outside (scripts/gpu_run.sh starts each rank under its own compute-sanitizer, so the
// checked processes are the ones running kernels, not children of a fork).
std::vector<RankOutcome> on_gpus(const std::function<void(GpuRank&)>& body, std::chrono::seconds deadline = 120s) {
  const char* env_rank = std::getenv("TORPOR_RANK");
  const char* env_rv = std::getenv("TORPOR_GROUP_RENDEZVOUS");
  if (env_rank != nullptr && env_rv != nullptr) {
    RankOutcome o;
    try {
      GpuRank g;
      std::string skip = open_rank(std::stoi(env_rank), Rendezvous::parse(env_rv), g);
      if (!skip.empty()) {
        o.report = "SKIP: " + skip;
      } else {
        body(g);
        g.group->barrier();
      }
      o.exit_code = 0;
    } catch (const std::exception& e) {
      o.report = std::string("rank ") + env_rank + " failed: " + e.what();
      o.exit_code = 1;
    }
    return {o};
  }
  const Rendezvous rv = Rendezvous::create();
  auto outcomes = run_ranks(
      ranks,
      [&](int r) {
        GpuRank g;
        std::string skip = open_rank(r, rv, g);
        if (!skip.empty()) {
          report("SKIP: " + skip);
          return;
        }
        body(g);
        g.group->barrier();
      },
      deadline);
  rv.remove();
  return outcomes;
}

// Device tensors of one rank, in torpor memory (tag "activations", class state), so they keep
// their addresses and bytes through sleep like the runner's would.
struct DeviceCall {
  DeviceCall(Pool& pool, const TailShape& s) : pool_(pool), s_(s) {
    const std::size_t th = static_cast<std::size_t>(s.max_tokens) * s.hidden;
    auto alloc = [&](std::size_t bytes, const char* name) {
      return pool.allocate(bytes, {"activations", MemoryClass::state, name});
    };
    expert = static_cast<bf16*>(alloc(th * s.top_k * sizeof(bf16), "expert_out"));
    shared = static_cast<bf16*>(alloc(th * sizeof(bf16), "shared_out"));
    residual = static_cast<bf16*>(alloc(th * sizeof(bf16), "residual_in"));
    gamma = static_cast<bf16*>(alloc(static_cast<std::size_t>(s.hidden) * sizeof(bf16), "gamma"));
    residual_out = static_cast<bf16*>(alloc(th * sizeof(bf16), "residual_out"));
    norm_out = static_cast<bf16*>(alloc(th * sizeof(bf16), "norm_out"));
    weights = static_cast<float*>(alloc(static_cast<std::size_t>(s.max_tokens) * s.top_k * sizeof(float), "weights"));
  }
  ~DeviceCall() {
    for (void* p : {static_cast<void*>(expert), static_cast<void*>(shared), static_cast<void*>(residual),
                    static_cast<void*>(gamma), static_cast<void*>(residual_out), static_cast<void*>(norm_out),
                    static_cast<void*>(weights)})
      try {
        pool_.deallocate(p);
      } catch (...) {
      }
  }
  void upload(const CallInputs& c, int rank) {
    const RankInputs& in = c.ranks[static_cast<std::size_t>(rank)];
    cuda(cudaMemcpy(expert, in.expert.data(), in.expert.size() * sizeof(bf16), cudaMemcpyHostToDevice), "upload");
    cuda(cudaMemcpy(weights, in.weights.data(), in.weights.size() * sizeof(float), cudaMemcpyHostToDevice), "upload");
    cuda(cudaMemcpy(shared, in.shared.data(), in.shared.size() * sizeof(bf16), cudaMemcpyHostToDevice), "upload");
    cuda(cudaMemcpy(residual, c.residual.data(), c.residual.size() * sizeof(bf16), cudaMemcpyHostToDevice), "upload");
    cuda(cudaMemcpy(gamma, c.gamma.data(), c.gamma.size() * sizeof(bf16), cudaMemcpyHostToDevice), "upload");
    poison();  // settles
  }
  void poison() {  // 0xFFFF: a NaN no computation writes here
    const std::size_t th = static_cast<std::size_t>(s_.max_tokens) * s_.hidden * sizeof(bf16);
    cuda(cudaMemset(residual_out, 0xFF, th), "poison");
    cuda(cudaMemset(norm_out, 0xFF, th), "poison");
    settle();
  }
  std::vector<bf16> outputs(int tokens) const {
    const std::size_t n = static_cast<std::size_t>(tokens) * s_.hidden;
    std::vector<bf16> v(2 * n);
    cuda(cudaMemcpy(v.data(), residual_out, n * sizeof(bf16), cudaMemcpyDeviceToHost), "download");
    cuda(cudaMemcpy(v.data() + n, norm_out, n * sizeof(bf16), cudaMemcpyDeviceToHost), "download");
    return v;
  }
  TailArgs args(int tokens) const {
    TailArgs a;
    a.tokens = tokens;
    a.expert_out = expert;
    a.topk_weights = weights;
    a.shared_out = shared;
    a.residual_in = residual;
    a.gamma = gamma;
    a.residual_out = residual_out;
    a.norm_out = norm_out;
    return a;
  }

  Pool& pool_;
  TailShape s_;
  bf16 *expert, *shared, *residual, *gamma, *residual_out, *norm_out;
  float* weights;
};

fusion::TokenRange share_of(const TailShape& s, int tokens, int rank) {
  return s.mode == TailMode::all_reduce ? fusion::TokenRange{0, tokens} : fusion::token_share(tokens, rank, ranks);
}

// The GPU's outputs on the rank's share within bf16 bounds of the fp64 answer (fp64_reference:
// computed from the inputs in the test, independent of both paths); "" when they are.
std::string within_fp64_bounds(const TailShape& s, const CallInputs& c, const std::vector<bf16>& got, int rank) {
  const std::size_t n = static_cast<std::size_t>(c.tokens) * s.hidden;
  const auto share = share_of(s, c.tokens, rank);
  return check_outputs(fp64_reference(s, c), got.data(), got.data() + n, share.begin, share.end);
}

// The GPU's outputs against the oracle's (bit for bit on the rank's output rows, untouched
// elsewhere) and against fp64; "" when all is well.
std::string compare(const TailShape& s, const CallInputs& c, const std::vector<bf16>& got,
                    const std::vector<bf16>& want, int rank, bool bitwise = true) {
  const std::size_t n = static_cast<std::size_t>(c.tokens) * s.hidden;
  const auto share =
      s.mode == TailMode::all_reduce ? fusion::TokenRange{0, c.tokens} : fusion::token_share(c.tokens, rank, ranks);
  std::string out;
  for (int t = 0; t < c.tokens; ++t) {
    const bool mine = t >= share.begin && t < share.end;
    for (int col = 0; col < s.hidden; ++col)
      for (std::size_t half : {std::size_t{0}, n}) {
        const std::size_t i = half + static_cast<std::size_t>(t) * s.hidden + col;
        if (!mine && got[i].bits != 0xFFFF) return "token " + std::to_string(t) + " written outside the share";
        if (mine && bitwise && got[i].bits != want[i].bits && out.empty())
          out = "token " + std::to_string(t) + " col " + std::to_string(col) + (half ? " norm" : " residual") +
                ": GPU " + std::to_string(f(got[i])) + " vs CPU reference " + std::to_string(f(want[i]));
      }
  }
  if (!out.empty()) return "differs from the CPU reference: " + out;
  return within_fp64_bounds(s, c, got, rank);
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

void sync(GpuRank& g) { cuda(cudaStreamSynchronize(g.stream), "cudaStreamSynchronize"); }

// What `body` enqueues on `stream`, captured in a CUDA graph and instantiated. Destroyed with this
// object: declare it after the Tail whose calls it holds (and after NCCL communicators), so it
// goes first.
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void()>& body) {
    cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
    body();
    cuda(cudaStreamEndCapture(stream, &graph_), "end capture");
    cuda(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
  }
  ~CapturedGraph() {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) (void)cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void launch(cudaStream_t stream) { cuda(cudaGraphLaunch(exec_, stream), "graph launch"); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

const std::vector<int> gpu_tokens = {1, 8, 128, 3, 32, 128, 2, 77, 128, 5};

#endif  // TORPOR_KERNELS_CUDA

#if defined(TORPOR_KERNELS_CUDA)
#define TORPOR_REQUIRE_CUDA_BUILD()
#else
#define TORPOR_REQUIRE_CUDA_BUILD() GTEST_SKIP() << "built without the CUDA kernels (TORPOR_CUDA=OFF)"
#endif

// Fresh inputs each call, token counts rotating through the slots, both modes: bit for bit the
// CPU reference, and within bf16 bounds of fp64. Every row decomposition: the default (clusters of
// kernels::tail_cluster_blocks up to kernels::tail_cluster_max_rows rows, then one block per row),
// 8 blocks per row, and a hidden size whose rows leave most lanes idle.
TEST(TailCuda, FusedMatchesTheCpuReferenceBitwiseAndFp64) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus([](GpuRank& g) {
    for (auto [hidden, blocks_per_row, mode] :
         {std::tuple{7168, 0, TailMode::all_reduce}, std::tuple{7168, 0, TailMode::reduce_scatter},
          std::tuple{7168, 8, TailMode::all_reduce}, std::tuple{1024, 0, TailMode::reduce_scatter}}) {
      const TailShape s = gpu_shape(hidden, mode);
      TailOptions o;
      o.blocks_per_row = blocks_per_row;
      auto tail = make_tail(*g.heap, s, o);
      require(tail->path() == TailPath::fused_unicast, "path: " + tail->reason());
      DeviceCall d(*g.pool, s);
      for (std::size_t i = 0; i < gpu_tokens.size(); ++i) {
        const CallInputs c = random_call(s, ranks, gpu_tokens[i], 2000 + i);
        d.upload(c, g.rank);
        tail->run(d.args(c.tokens), g.torpor_stream());
        sync(g);
        tail->check();
        std::string bad = compare(s, c, d.outputs(c.tokens), oracle(s, c)[static_cast<std::size_t>(g.rank)], g.rank);
        require(bad.empty(), std::string(fusion::to_string(mode)) + ", hidden " + std::to_string(hidden) +
                                 ", blocks per row " + std::to_string(blocks_per_row) + ", call " + std::to_string(i) +
                                 ": " + bad);
      }
      g.group->barrier();
    }
  }));
#endif
}

// 1000 calls with the same inputs: every one gives the first one's bits (and the reference's).
TEST(TailCuda, BitwiseDeterministicAcross1000Calls) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus([](GpuRank& g) {
    const TailShape s = gpu_shape(7168);
    auto tail = make_tail(*g.heap, s);
    DeviceCall d(*g.pool, s);
    const CallInputs c = random_call(s, ranks, 8, 3000);
    d.upload(c, g.rank);
    const auto want = oracle(s, c)[static_cast<std::size_t>(g.rank)];
    for (int i = 0; i < 1000; ++i) {
      tail->run(d.args(8), g.torpor_stream());
      sync(g);
      require(d.outputs(8) == want, "call " + std::to_string(i) + " differs from the CPU reference");
    }
    tail->check();
  }));
#endif
}

// Captured in a CUDA graph before a level-2 sleep, replayed after wake: the graph's pointers
// (slots, control block, peer table, tensors) are the same addresses, the state came back bit for
// bit, and the replays are correct with no re-initialisation.
TEST(TailCuda, GraphCapturedBeforeSleepReplaysAfterWake) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus([](GpuRank& g) {
    const TailShape s = gpu_shape(7168);
    auto tail = make_tail(*g.heap, s);
    DeviceCall d(*g.pool, s);
    constexpr int per_graph = 4;  // calls per replay: the slots rotate inside the graph
    CapturedGraph graph(g.stream, [&] {
      for (int i = 0; i < per_graph; ++i) tail->run(d.args(16), g.torpor_stream());
    });
    auto replay_and_check = [&](std::uint64_t seed, const std::string& when) {
      const CallInputs c = random_call(s, ranks, 16, seed);
      d.upload(c, g.rank);
      g.group->barrier();
      graph.launch(g.stream);
      sync(g);
      tail->check();
      std::string bad = compare(s, c, d.outputs(16), oracle(s, c)[static_cast<std::size_t>(g.rank)], g.rank);
      require(bad.empty(), when + ": " + bad);
    };
    replay_and_check(4000, "replay before sleep");
    replay_and_check(4001, "second replay before sleep");
    auto state = *fusion::tail_state(*tail);
    const auto calls_before = [&] {
      kernels::TailControl c{};
      cuda(cudaMemcpy(&c, state.control, sizeof c, cudaMemcpyDeviceToHost), "read control");
      return c;
    }();
    require(calls_before.calls == 2 * per_graph, "graph replays advanced the control block");
    g.group->barrier();
    g.pool->sleep(2);
    for (const auto& t : g.pool->stats().tags)
      require(t.asleep && t.mapped_bytes == 0, "tag " + t.tag + " gave its memory back while asleep");
    g.group->barrier();
    g.pool->wake_up();
    kernels::TailControl after{};
    cuda(cudaMemcpy(&after, state.control, sizeof after, cudaMemcpyDeviceToHost), "read control");
    require(std::memcmp(&after, &calls_before, sizeof after) == 0, "control block restored bit for bit");
    replay_and_check(4002, "replay after wake");
    replay_and_check(4003, "second replay after wake");
  }));
#endif
}

// Calls enqueued back to back with no host sync between them, each adding into the residual in
// place (residual_out is residual_in) and the token count changing every call, so every call
// reads what the one before it wrote and clears what it received. A call that ran ahead of its
// predecessor (a programmatic launch touching memory before its griddepcontrol.wait, a slot
// cleared or a control block advanced too early) gives other bits than the CPU reference run
// call by call. With and without programmatic launch; on the stream, then captured in a graph.
TEST(TailCuda, BackToBackCallsChainThroughTheResidual) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus([](GpuRank& g) {
    const TailShape s = gpu_shape(7168);
    const std::vector<int> chain = {8, 1, 128, 3, 32, 8, 77, 2, 128, 16, 5, 64};
    const CallInputs base = random_call(s, ranks, s.max_tokens, 8000);
    const std::size_t h = static_cast<std::size_t>(s.hidden);
    // The oracle, call by call: call i sees rows [0, tokens) of base and the residual so far.
    std::vector<bf16> residual = base.residual;
    std::vector<bf16> last_norm;
    for (int t : chain) {
      const std::size_t n = static_cast<std::size_t>(t) * h;
      CallInputs c;
      c.tokens = t;
      c.gamma = base.gamma;
      c.residual.assign(residual.begin(), residual.begin() + static_cast<std::ptrdiff_t>(n));
      for (const RankInputs& in : base.ranks) {
        RankInputs cut;
        cut.expert.assign(in.expert.begin(), in.expert.begin() + static_cast<std::ptrdiff_t>(n * s.top_k));
        cut.weights.assign(in.weights.begin(), in.weights.begin() + static_cast<std::ptrdiff_t>(t) * s.top_k);
        cut.shared.assign(in.shared.begin(), in.shared.begin() + static_cast<std::ptrdiff_t>(n));
        c.ranks.push_back(std::move(cut));
      }
      const auto out = oracle(s, c)[static_cast<std::size_t>(g.rank)];
      std::copy(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(n), residual.begin());
      last_norm.assign(out.begin() + static_cast<std::ptrdiff_t>(n), out.end());
    }
    for (bool programmatic : {true, false}) {
      TailOptions o;
      o.programmatic_launch = programmatic;
      auto tail = make_tail(*g.heap, s, o);
      DeviceCall d(*g.pool, s);
      d.upload(base, g.rank);
      for (bool in_graph : {false, true}) {
        const std::string how =
            std::string(programmatic ? "programmatic" : "stream-order") + (in_graph ? ", graph" : ", stream");
        cuda(cudaMemcpy(d.residual, base.residual.data(), base.residual.size() * sizeof(bf16), cudaMemcpyHostToDevice),
             "upload");
        d.poison();
        auto args = [&](int t) {
          TailArgs a = d.args(t);
          a.residual_out = d.residual;
          return a;
        };
        auto run_chain = [&] {
          for (int t : chain) tail->run(args(t), g.torpor_stream());
        };
        std::optional<CapturedGraph> graph;
        if (in_graph) graph.emplace(g.stream, run_chain);
        g.group->barrier();
        if (graph) {
          graph->launch(g.stream);
        } else {
          run_chain();
        }
        sync(g);
        tail->check();
        std::vector<bf16> got(residual.size()), norm(last_norm.size());
        cuda(cudaMemcpy(got.data(), d.residual, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost), "download");
        cuda(cudaMemcpy(norm.data(), d.norm_out, norm.size() * sizeof(bf16), cudaMemcpyDeviceToHost), "download");
        for (std::size_t i = 0; i < got.size(); ++i)
          require(got[i].bits == residual[i].bits, how + ": residual element " + std::to_string(i) + " (token " +
                                                       std::to_string(i / h) + ") is " + std::to_string(f(got[i])) +
                                                       ", the reference chain gives " + std::to_string(f(residual[i])));
        for (std::size_t i = 0; i < norm.size(); ++i)
          require(norm[i].bits == last_norm[i].bits, how + ": the last call's norm_out element " + std::to_string(i) +
                                                         " differs from the reference chain");
      }
      g.group->barrier();
    }
  }));
#endif
}

// Negative controls on the GPU: (1) rank 1's control block zeroed after wake: rank 1 refuses
// (invalid_state), rank 0 times out (timeout_error naming rank 1); (2) rank 0's slots zeroed to
// +0.0 while rank 1 calls late: rank 0's result is wrong and the check says so. Then reset() and
// correct again. Never a hang.
TEST(TailCuda, NegativeControlsAreDetectedNeverAHang) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus([](GpuRank& g) {
    const TailShape s = gpu_shape(1024);
    TailOptions o;
    o.wait_timeout = 1000ms;
    auto tail = make_tail(*g.heap, s, o);
    DeviceCall d(*g.pool, s);
    auto call = [&](std::uint64_t seed) {
      const CallInputs c = random_call(s, ranks, 8, seed);
      d.upload(c, g.rank);
      tail->run(d.args(8), g.torpor_stream());
      sync(g);
      return c;
    };
    auto correct = [&](const CallInputs& c, const std::string& when) {
      tail->check();
      std::string bad = compare(s, c, d.outputs(8), oracle(s, c)[static_cast<std::size_t>(g.rank)], g.rank);
      require(bad.empty(), when + ": " + bad);
    };
    correct(call(5000), "first call");
    correct(call(5001), "second call");
    g.pool->sleep(2);
    g.group->barrier();
    g.pool->wake_up();
    auto state = *fusion::tail_state(*tail);
    if (g.rank == 1) cuda(cudaMemset(state.control, 0, state.control_bytes), "zero the control block");
    settle();
    g.group->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    call(5002);
    try {
      tail->check();
      require(false, "a zeroed control block went unnoticed");
    } catch (const invalid_state& e) {
      require(g.rank == 1 && std::string(e.what()).find("control block is not valid (magic 0x0") != std::string::npos,
              e.what());
    } catch (const timeout_error& e) {
      require(g.rank == 0 && std::string(e.what()).find("for rank 1's partial") != std::string::npos, e.what());
    }
    require(std::chrono::steady_clock::now() - t0 < 20s, "no hang");
    g.group->barrier();
    tail->reset();
    correct(call(5003), "after reset");

    if (g.rank == 0) cuda(cudaMemset(state.slots->local(), 0, state.slot_bytes), "zero the slots");
    settle();
    g.group->barrier();
    if (g.rank == 1) std::this_thread::sleep_for(300ms);
    const CallInputs c = call(5004);
    tail->check();
    std::string bad = compare(s, c, d.outputs(8), oracle(s, c)[static_cast<std::size_t>(g.rank)], g.rank);
    if (g.rank == 0)
      require(!bad.empty(), "zeroed slots must give a result the check rejects");
    else
      require(bad.empty(), "rank 1's slots were intact: " + bad);
    g.group->barrier();
    tail->reset();
    correct(call(5005), "after the second reset");
  }));
#endif
}

// I5 on the row barrier: a fused call (clusters of kernels::tail_cluster_blocks blocks per row)
// whose block 1 of every cluster never pushes its sums of squares of its first row
// (launch_tail_fused_withholding_push, a test-only variant of the kernel). The blocks waiting on
// that row's barrier give up after twice the wait bound instead of spinning forever; check()
// names the cluster barrier; after reset() on both ranks, calls are correct again.
TEST(TailCuda, RowBarrierThatNeverCompletesIsBoundedAndReported) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus([](GpuRank& g) {
    const TailShape s = gpu_shape(7168);
    TailOptions o;
    o.wait_timeout = 500ms;
    o.blocks_per_row = kernels::tail_cluster_blocks;
    auto tail = make_tail(*g.heap, s, o);
    require(tail->path() == TailPath::fused_unicast, "path: " + tail->reason());
    const auto state = *fusion::tail_state(*tail);
    DeviceCall d(*g.pool, s);
    const CallInputs c = random_call(s, ranks, 8, 9000);
    d.upload(c, g.rank);
    const fusion::TailArgs a = d.args(8);
    kernels::TailParams p;
    p.expert_out = a.expert_out;
    p.topk_weights = a.topk_weights;
    p.shared_out = a.shared_out;
    p.residual_in = a.residual_in;
    p.gamma = a.gamma;
    p.residual_out = a.residual_out;
    p.norm_out = a.norm_out;
    p.tokens = 8;
    p.hidden = s.hidden;
    p.top_k = s.top_k;
    p.max_tokens = s.max_tokens;
    p.ranks = ranks;
    p.rank = g.rank;
    p.eps = s.eps;
    p.peer_table = static_cast<const std::uint64_t*>(state.slots->peer_table());
    p.control = static_cast<kernels::TailControl*>(state.control);
    p.timeout_ns = 500'000'000;
    g.group->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    kernels::launch_tail_fused_withholding_push(p,
                                                kernels::tail_fused_capacity(s.hidden, false,
                                                                             kernels::tail_cluster_blocks),
                                                g.torpor_stream());
    sync(g);
    const auto took = std::chrono::steady_clock::now() - t0;
    require(took < 5s, "the call with a withheld push took " +
                           std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
                           " ms; its row barrier is bounded by twice the wait bound (1000 ms)");
    std::string said;
    try {
      tail->check();
    } catch (const timeout_error& e) {
      said = e.what();
    }
    require(said.find("cluster's sums of squares") != std::string::npos,
            "check() names the row barrier that never completed: '" + said + "'");
    g.group->barrier();
    tail->reset();
    const CallInputs c2 = random_call(s, ranks, 8, 9001);
    d.upload(c2, g.rank);
    d.poison();
    tail->run(d.args(8), g.torpor_stream());
    sync(g);
    tail->check();
    const std::string bad = compare(s, c2, d.outputs(8), oracle(s, c2)[static_cast<std::size_t>(g.rank)], g.rank);
    require(bad.empty(), "after reset: " + bad);
  }));
#endif
}

// The unfused path (finalize, NCCL all-reduce of the fp32 partials, residual + RMSNorm) against
// the fused one as an independent oracle, directly and captured in a graph. Both round each
// partial to bf16 once and sum the ranks' partials in fp32; with two ranks an element's sum is one
// fp32 addition of the same two values on either path (addition commutes; NCCL's two-rank ring
// and tree both do exactly one), and the epilogue is the same code: the outputs must be the same
// bits. (With more ranks NCCL's order differs from rank order and this would be a bound, not
// equality.) Each path's output is also held within bf16 bounds of the fp64 answer.
TEST(TailCuda, UnfusedAgreesWithFused) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  static_assert(ranks == 2, "bitwise agreement of the two paths holds for two ranks (see above)");
  expect_ranks(on_gpus([](GpuRank& g) {
    const TailShape s = gpu_shape(7168);
    auto fused = make_tail(*g.heap, s);
    require(fused->path() == TailPath::fused_unicast, "fused path: " + fused->reason());
    TailOptions o;
    o.allow_fused = false;
    auto unfused = make_tail(*g.heap, s, o);
    require(unfused->path() == TailPath::unfused, "unfused path: " + unfused->reason());
    DeviceCall d(*g.pool, s);
    auto fused_outputs = [&](const CallInputs& c) {
      d.poison();
      fused->run(d.args(c.tokens), g.torpor_stream());
      sync(g);
      fused->check();
      return d.outputs(c.tokens);
    };
    for (std::size_t i = 0; i < gpu_tokens.size(); ++i) {
      const CallInputs c = random_call(s, ranks, gpu_tokens[i], 6000 + i);
      d.upload(c, g.rank);
      const auto f_out = fused_outputs(c);
      d.poison();
      unfused->run(d.args(c.tokens), g.torpor_stream());
      sync(g);
      unfused->check();
      const auto u_out = d.outputs(c.tokens);
      const std::string call = "call " + std::to_string(i) + ": ";
      std::string bad = within_fp64_bounds(s, c, f_out, g.rank);
      require(bad.empty(), call + "fused output not within bf16 bounds of fp64: " + bad);
      bad = within_fp64_bounds(s, c, u_out, g.rank);
      require(bad.empty(), call + "unfused output not within bf16 bounds of fp64: " + bad);
      bad = compare(s, c, u_out, f_out, g.rank);
      require(bad.empty(), call + "unfused output is not the fused one's bits: " + bad);
    }
    // In a graph as well (NCCL captured), held against the fused output of the same inputs; the
    // graph goes before the communicator (declared later).
    const CallInputs c = random_call(s, ranks, 32, 6100);
    d.upload(c, g.rank);
    const auto f_out = fused_outputs(c);
    CapturedGraph graph(g.stream, [&] { unfused->run(d.args(32), g.torpor_stream()); });
    d.poison();
    graph.launch(g.stream);
    sync(g);
    unfused->check();
    const auto u_out = d.outputs(32);
    std::string bad = within_fp64_bounds(s, c, u_out, g.rank);
    require(bad.empty(), "unfused in a graph, not within bf16 bounds of fp64: " + bad);
    bad = compare(s, c, u_out, f_out, g.rank);
    require(bad.empty(), "unfused in a graph is not the fused output's bits: " + bad);
  }));
#endif
}

// Partials of -0.0 (exact, and subnormals rounding to it), NaN (quiet, negative with a payload)
// and +-inf (tail_oracle.hpp's special_call): both paths give the tail's definition
// (tail_by_definition, computed in the test) bit for bit on the rank's share, both modes. The
// host suite's TailThreads.SpecialPartialsGiveTheDefinitionsBitsOnBothPaths on the GPU.
TEST(TailCuda, SpecialPartialsGiveTheDefinitionsBits) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus([](GpuRank& g) {
    for (TailMode mode : {TailMode::all_reduce, TailMode::reduce_scatter})
      for (bool fused : {true, false}) {
        const std::string what = std::string(fusion::to_string(mode)) + (fused ? ", fused" : ", unfused");
        const TailShape s = gpu_shape(7168, mode);
        TailOptions o;
        o.allow_fused = fused;
        auto tail = make_tail(*g.heap, s, o);
        require(tail->path() == (fused ? TailPath::fused_unicast : TailPath::unfused),
                what + ": path " + tail->reason());
        DeviceCall d(*g.pool, s);
        for (int tokens : {8, 5, 128, 4}) {
          const CallInputs c = special_call(s, ranks, tokens, 8000 + static_cast<std::uint64_t>(tokens));
          d.upload(c, g.rank);
          d.poison();
          tail->run(d.args(tokens), g.torpor_stream());
          sync(g);
          tail->check();
          const auto share = share_of(s, tokens, g.rank);
          const std::string bad = first_difference(d.outputs(tokens), tail_by_definition(s, c), s.hidden, share.begin,
                                                   share.end, "the definition");
          require(bad.empty(), what + ", " + std::to_string(tokens) + " tokens: " + bad);
        }
      }
  }));
#endif
}

// The fused kernel's bf16 rounding (cvt.rn.bf16x2, NaN made canonical) of every one of the 2^32
// float patterns, against the IEEE definition written in the test (tail_oracle.hpp's ieee_bf16,
// which TailProtocol.Bf16RoundingIsTheIeeeDefinitions also holds the CPU's rounding against).
// One GPU, in a child process (the parent never touches CUDA).
TEST(GpuTail, Bf16RoundingOfEveryFloatIsTheIeeeDefinitions) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(run_ranks(
      1,
      [](int) {
        int devices = 0;
        if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
          report("SKIP: no usable GPU");
          return;
        }
        cuda(cudaSetDevice(0), "cudaSetDevice");
        constexpr std::size_t chunk = std::size_t{1} << 28;
        std::uint16_t* dev = nullptr;
        cuda(cudaMalloc(&dev, chunk * sizeof(std::uint16_t)), "cudaMalloc");
        std::vector<std::uint16_t> got(chunk);
        const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
        std::string bad;
        for (std::uint64_t first = 0; first < (std::uint64_t{1} << 32) && bad.empty(); first += chunk) {
          kernels::launch_tail_round_floats(static_cast<std::uint32_t>(first), chunk, dev,
                                            kernels::from_native(nullptr, 0));
          cuda(cudaMemcpy(got.data(), dev, chunk * sizeof(std::uint16_t), cudaMemcpyDeviceToHost), "download");
          std::vector<std::string> found(workers);
          std::vector<std::thread> pool;
          for (unsigned w = 0; w < workers; ++w)
            pool.emplace_back([&, w] {
              for (std::size_t i = w; i < chunk; i += workers) {
                const auto u = static_cast<std::uint32_t>(first + i);
                if (got[i] != ieee_bf16(u)) {
                  char text[96];
                  std::snprintf(text, sizeof text, "float bits 0x%08x: GPU 0x%04x, the definition 0x%04x", u, got[i],
                                ieee_bf16(u));
                  found[w] = text;
                  return;
                }
              }
            });
          for (auto& t : pool) t.join();
          for (const auto& f : found)
            if (!f.empty() && bad.empty()) bad = f;
        }
        (void)cudaFree(dev);
        require(bad.empty(), bad);
      },
      600s));
#endif
}

// Small and quick, for compute-sanitizer (memcheck, racecheck): fused in both modes, a graph,
// a reset, and the unfused path's two kernels on their own (no NCCL under the sanitizer).
TEST(TailCuda, SanitizerSmoke) {
  TORPOR_REQUIRE_CUDA_BUILD();
#if defined(TORPOR_KERNELS_CUDA)
  expect_ranks(on_gpus(
      [](GpuRank& g) {
        for (TailMode mode : {TailMode::all_reduce, TailMode::reduce_scatter}) {
          TailShape s = gpu_shape(1024, mode);
          s.top_k = 2;
          TailOptions o;
          o.wait_timeout = 60000ms;  // instrumented kernels are slow
          auto tail = make_tail(*g.heap, s, o);
          DeviceCall d(*g.pool, s);
          for (int tokens : {1, 5, 33}) {
            const CallInputs c = random_call(s, ranks, tokens, 7000 + static_cast<std::uint64_t>(tokens));
            d.upload(c, g.rank);
            tail->run(d.args(tokens), g.torpor_stream());
            sync(g);
            tail->check();
            std::string bad = compare(s, c, d.outputs(tokens), oracle(s, c)[static_cast<std::size_t>(g.rank)], g.rank);
            require(bad.empty(), bad);
          }
          {
            CapturedGraph graph(g.stream, [&] {
              tail->run(d.args(4), g.torpor_stream());
              tail->run(d.args(4), g.torpor_stream());
            });
            const CallInputs c = random_call(s, ranks, 4, 7100);
            d.upload(c, g.rank);
            graph.launch(g.stream);
            sync(g);
            tail->check();
            std::string bad = compare(s, c, d.outputs(4), oracle(s, c)[static_cast<std::size_t>(g.rank)], g.rank);
            require(bad.empty(), "graph: " + bad);
          }
          tail->reset();
        }
        // The unfused kernels without the all-reduce: reduced = this rank's own partials.
        const TailShape s = gpu_shape(1024);
        DeviceCall d(*g.pool, s);
        const CallInputs c = random_call(s, 1, 7, 7200 + static_cast<std::uint64_t>(g.rank));
        d.upload(c, 0);
        kernels::TailParams p;
        p.expert_out = d.expert;
        p.topk_weights = d.weights;
        p.shared_out = d.shared;
        p.residual_in = d.residual;
        p.gamma = d.gamma;
        p.residual_out = d.residual_out;
        p.norm_out = d.norm_out;
        p.tokens = 7;
        p.hidden = s.hidden;
        p.top_k = s.top_k;
        p.max_tokens = s.max_tokens;
        p.ranks = 1;
        p.eps = s.eps;
        void* partial = g.pool->allocate(7 * static_cast<std::size_t>(s.hidden) * sizeof(float),
                                         {"activations", MemoryClass::cache, "partial"});
        kernels::launch_tail_finalize(p, static_cast<float*>(partial), g.torpor_stream());
        kernels::launch_tail_residual_norm(p, static_cast<const float*>(partial), g.torpor_stream());
        sync(g);
        const auto got = d.outputs(7);
        g.pool->deallocate(partial);
        // The CPU reference with one rank is exactly these two steps.
        RankBuffers b(s, s.max_tokens);
        b.load(c, 0);
        b.poison_outputs();
        p.expert_out = b.expert.data();
        p.topk_weights = b.weights.data();
        p.shared_out = b.shared.data();
        p.residual_in = b.residual.data();
        p.gamma = b.gamma.data();
        p.residual_out = b.residual_out.data();
        p.norm_out = b.norm_out.data();
        std::vector<bf16> part(7 * static_cast<std::size_t>(s.hidden));
        kernels::reference_finalize(p, part.data());
        std::vector<float> sum(part.size());
        for (std::size_t i = 0; i < part.size(); ++i) sum[i] = f(part[i]);
        kernels::reference_residual_norm(p, sum.data());
        const std::size_t n = part.size();
        require(same_bits(got.data(), b.residual_out.data(), n) && same_bits(got.data() + n, b.norm_out.data(), n),
                "unfused kernels differ from the CPU reference");
      },
      140s));
#endif
}

}  // namespace
}  // namespace torpor::test
