// LatentMoERunner against an independent CPU oracle of the whole (unsharded) MoE layer: router,
// top-k, latent down, every expert at full intermediate size, up, shared expert, weighted sum,
// residual, RMSNorm. Sharding the intermediate dimension over 1, 2 and 4 ranks must give the
// oracle's result (within bf16 rounding) and bit-identical outputs on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ranks.hpp"
#include "torpor/fusion/compute.hpp"
#include "torpor/fusion/latent_moe.hpp"
#include "torpor/kernels/moe_ops.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::fusion {
namespace {

constexpr int H = 64, Lt = 32, E = 4, K = 2, I = 64, S = 32, T = 3;

struct Full {  // the logical layer, fp32 values that are exact in bf16
  std::vector<float> router, down, gate, upw, expd, sgate, sup, sdown, up, x, residual, gamma;
};

float q(float v) { return bf16::from_float(v).to_float(); }

Full make_full() {
  std::mt19937 rng(3);
  auto fill = [&](std::size_t n, float scale) {
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = q(u(rng));
    return v;
  };
  Full f;
  f.router = fill(E * H, 0.5f);
  f.down = fill(Lt * H, 0.2f);
  f.gate = fill(E * I * Lt, 0.3f);
  f.upw = fill(E * I * Lt, 0.3f);
  f.expd = fill(E * Lt * I, 0.2f);
  f.sgate = fill(S * Lt, 0.3f);
  f.sup = fill(S * Lt, 0.3f);
  f.sdown = fill(Lt * S, 0.2f);
  f.up = fill(H * Lt, 0.2f);
  f.x = fill(T * H, 1.f);
  f.residual = fill(T * H, 1.f);
  f.gamma = fill(H, 1.f);
  return f;
}

// fp32 oracle of sum over experts and ranks, then residual + RMSNorm.
void oracle(const Full& f, std::vector<float>& residual_out, std::vector<float>& norm_out) {
  residual_out.assign(T * H, 0.f);
  norm_out.assign(T * H, 0.f);
  auto silu = [](float g) { return g / (1.f + std::exp(-g)); };
  for (int t = 0; t < T; ++t) {
    std::vector<float> logits(E), lat(Lt, 0.f), moe(H, 0.f);
    for (int e = 0; e < E; ++e)
      for (int h = 0; h < H; ++h) logits[e] += f.x[t * H + h] * f.router[e * H + h];
    std::vector<std::int32_t> idx(K);
    std::vector<float> w(K);
    kernels::ref::router_topk(logits.data(), 1, E, K, idx.data(), w.data());
    for (int l = 0; l < Lt; ++l)
      for (int h = 0; h < H; ++h) lat[l] += f.x[t * H + h] * f.down[l * H + h];
    auto expert = [&](const float* g, const float* u, const float* d, int inter) {
      std::vector<float> y(Lt, 0.f);
      for (int i = 0; i < inter; ++i) {
        float gv = 0, uv = 0;
        for (int l = 0; l < Lt; ++l) {
          gv += lat[l] * g[i * Lt + l];
          uv += lat[l] * u[i * Lt + l];
        }
        float a = silu(gv) * uv;
        for (int l = 0; l < Lt; ++l) y[l] += a * d[l * inter + i];
      }
      return y;
    };
    std::vector<float> ylat(Lt, 0.f);
    for (int k = 0; k < K; ++k) {
      int e = idx[k];
      auto y = expert(&f.gate[e * I * Lt], &f.upw[e * I * Lt], &f.expd[e * Lt * I], I);
      for (int l = 0; l < Lt; ++l) ylat[l] += w[k] * y[l];
    }
    auto ys = expert(f.sgate.data(), f.sup.data(), f.sdown.data(), S);
    for (int l = 0; l < Lt; ++l) ylat[l] += ys[l];
    for (int h = 0; h < H; ++h)
      for (int l = 0; l < Lt; ++l) moe[h] += ylat[l] * f.up[h * Lt + l];
    float ss = 0;
    for (int h = 0; h < H; ++h) {
      residual_out[t * H + h] = f.residual[t * H + h] + moe[h];
      ss += residual_out[t * H + h] * residual_out[t * H + h];
    }
    float s = 1.f / std::sqrt(ss / H + 1e-6f);
    for (int h = 0; h < H; ++h) norm_out[t * H + h] = residual_out[t * H + h] * s * f.gamma[h];
  }
}

// This rank's slices, in the runner's layouts (latent_moe.hpp).
struct Shard {
  std::vector<bf16> router, down, gate_up, expd, sgate_up, sdown, up;
};
std::vector<bf16> B(const std::vector<float>& v) {
  std::vector<bf16> o;
  for (float x : v) o.push_back(bf16::from_float(x));
  return o;
}
Shard shard(const Full& f, int rank, int ranks) {
  Shard s;
  s.router = B(f.router);
  s.down = B(f.down);
  s.up = B(f.up);
  auto gu = [&](const std::vector<float>& g, const std::vector<float>& u, int experts, int inter) {
    const int ir = inter / ranks;
    std::vector<bf16> out;
    for (int e = 0; e < experts; ++e)
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < ir; ++j)
          for (int l = 0; l < Lt; ++l)
            out.push_back(bf16::from_float((half == 0 ? g : u)[(e * inter + rank * ir + j) * Lt + l]));
    return out;
  };
  auto dn = [&](const std::vector<float>& d, int experts, int inter) {
    const int ir = inter / ranks;
    std::vector<bf16> out;
    for (int e = 0; e < experts; ++e)
      for (int l = 0; l < Lt; ++l)
        for (int c = 0; c < ir; ++c) out.push_back(bf16::from_float(d[(e * Lt + l) * inter + rank * ir + c]));
    return out;
  };
  s.gate_up = gu(f.gate, f.upw, E, I);
  s.expd = dn(f.expd, E, I);
  s.sgate_up = gu(f.sgate, f.sup, 1, S);
  s.sdown = dn(f.sdown, 1, S);
  return s;
}

class RunnerVsOracle : public ::testing::TestWithParam<int> {};

TEST_P(RunnerVsOracle, ShardedLayerMatchesTheWholeLayer) {
  const int ranks = GetParam();
  const Full f = make_full();
  std::vector<float> want_res, want_norm;
  oracle(f, want_res, want_norm);
  std::vector<std::vector<bf16>> res(static_cast<std::size_t>(ranks)), norm(static_cast<std::size_t>(ranks));
  auto errors = test::on_ranks(ranks, [&](int rank, Group& g, HostDriver& d) {
    PoolOptions po;
    po.device = rank;
    po.exportable = true;
    po.va_bytes = std::size_t{256} << 20;
    Pool pool(d, po);
    SymmetricHeap heap(pool, g);
    auto compute = make_compute(d, rank);
    Shard s = shard(f, rank, ranks);
    auto put = [&](const std::vector<bf16>& v, const char* name) {
      void* p = pool.allocate(v.size() * 2, {"weights", MemoryClass::parameter, name});
      pool.copy(p, v.data(), v.size() * 2);
      return static_cast<const bf16*>(p);
    };
    LatentMoEWeights w;
    w.router = put(s.router, "router");
    w.down = put(s.down, "down");
    w.experts_gate_up = put(s.gate_up, "experts.gate_up");
    w.experts_down = put(s.expd, "experts.down");
    w.shared_gate_up = put(s.sgate_up, "shared.gate_up");
    w.shared_down = put(s.sdown, "shared.down");
    w.up = put(s.up, "up");
    LatentMoEConfig c{H, Lt, E, K, I, S, 4, 1e-6f};
    LatentMoERunner runner(heap, *compute, c, w);
    auto x = put(B(f.x), "x");
    auto residual = put(B(f.residual), "residual");
    auto gamma = put(B(f.gamma), "gamma");
    auto* ro = static_cast<bf16*>(pool.allocate(T * H * 2, {"kv_cache", MemoryClass::cache, "ro"}));
    auto* no = static_cast<bf16*>(pool.allocate(T * H * 2, {"kv_cache", MemoryClass::cache, "no"}));
    runner.run(T, x, residual, gamma, ro, no);
    compute->synchronize();
    runner.check();
    res[static_cast<std::size_t>(rank)].resize(T * H);
    norm[static_cast<std::size_t>(rank)].resize(T * H);
    pool.copy(res[static_cast<std::size_t>(rank)].data(), ro, T * H * 2);
    pool.copy(norm[static_cast<std::size_t>(rank)].data(), no, T * H * 2);
    if (runner.ranks() != ranks || runner.rank() != rank) throw std::runtime_error("rank bookkeeping");
  });
  ASSERT_EQ(test::all_errors(errors), "");
  for (int r = 1; r < ranks; ++r) {
    EXPECT_EQ(res[static_cast<std::size_t>(r)], res[0]) << "rank " << r << " residual differs from rank 0";
    EXPECT_EQ(norm[static_cast<std::size_t>(r)], norm[0]) << "rank " << r << " norm differs from rank 0";
  }
  double worst = 0;
  for (int i = 0; i < T * H; ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(res[0][static_cast<std::size_t>(i)].to_float() -
                                                          want_res[static_cast<std::size_t>(i)])));
    EXPECT_NEAR(res[0][static_cast<std::size_t>(i)].to_float(), want_res[static_cast<std::size_t>(i)],
                0.03f + 0.02f * std::fabs(want_res[static_cast<std::size_t>(i)]))
        << "residual element " << i;
    EXPECT_NEAR(norm[0][static_cast<std::size_t>(i)].to_float(), want_norm[static_cast<std::size_t>(i)],
                0.03f + 0.03f * std::fabs(want_norm[static_cast<std::size_t>(i)]))
        << "norm element " << i;
  }
  // The MoE part must be material, or the comparison above would prove little.
  double moe = 0;
  for (int i = 0; i < T * H; ++i)
    moe += std::fabs(want_res[static_cast<std::size_t>(i)] - f.residual[static_cast<std::size_t>(i)]);
  EXPECT_GT(moe / (T * H), 0.05) << "the oracle's MoE output is too small to test anything";
}

INSTANTIATE_TEST_SUITE_P(Ranks, RunnerVsOracle, ::testing::Values(1, 2, 4));

}  // namespace
}  // namespace torpor::fusion
