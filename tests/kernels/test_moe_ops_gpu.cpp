// The cuda Compute (cuBLAS GEMMs + kernels/moe_ops.cu) against the CPU references, op by op, on
// random inputs. Tolerances: bf16 outputs within 2% relative (plus a small absolute floor, since
// summation order differs); discrete outputs (routing, argmax, pointers) exactly. Skips, saying
// why, without a usable GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "driver/cuda_driver.hpp"
#include "torpor/fusion/compute.hpp"
#include "torpor/kernels/moe_ops.hpp"

namespace torpor::kernels {
namespace {

template <typename T>
struct Dev {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Dev(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit Dev(std::size_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, n * sizeof(T)), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

class GpuKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    driver_ = CudaDriver::open(&why);
    if (!driver_) GTEST_SKIP() << "no usable GPU: " << why;
    compute_ = fusion::make_compute(*driver_, 0);
  }
  std::vector<bf16> rand_bf16(std::size_t n, float scale = 1.f) {
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<bf16> v(n);
    for (auto& x : v) x = bf16::from_float(u(rng_));
    return v;
  }
  static void expect_close(const std::vector<bf16>& got, const std::vector<bf16>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      float g = got[i].to_float(), w = want[i].to_float();
      ASSERT_NEAR(g, w, 0.02f * std::fabs(w) + 0.02f) << what << " element " << i;
    }
  }
  std::unique_ptr<CudaDriver> driver_;
  std::unique_ptr<fusion::Compute> compute_;
  std::mt19937 rng_{42};
};

TEST_F(GpuKernels, LinearMatchesReference) {
  const int m = 7, n = 33, k = 64;
  auto x = rand_bf16(m * k), w = rand_bf16(n * k, 0.2f);
  Dev<bf16> dx(x), dw(w), dy(m * n);
  Dev<float> dyf(m * n);
  compute_->linear(dx.p, dw.p, dy.p, m, n, k);
  compute_->linear(dx.p, dw.p, dyf.p, m, n, k);
  compute_->synchronize();
  std::vector<bf16> want(m * n);
  std::vector<float> wantf(m * n);
  ref::linear(x.data(), w.data(), want.data(), m, n, k);
  ref::linear(x.data(), w.data(), wantf.data(), m, n, k);
  expect_close(dy.get(), want, "linear bf16");
  auto gotf = dyf.get();
  for (int i = 0; i < m * n; ++i) ASSERT_NEAR(gotf[i], wantf[i], 1e-3f + 1e-3f * std::fabs(wantf[i]));
}

TEST_F(GpuKernels, BatchedLinearThroughDevicePointerArraysMatchesReference) {
  const int count = 6, n = 40, k = 24;
  auto x = rand_bf16(count * k), w = rand_bf16(3 * n * k, 0.3f);
  Dev<bf16> dx(x), dw(w), dy(count * n);
  std::vector<const bf16*> xs, ws, xs_h, ws_h;
  std::vector<bf16*> ys;
  std::vector<bf16> want(count * n);
  std::vector<bf16*> ys_h;
  for (int i = 0; i < count; ++i) {
    xs.push_back(dx.p + i * k);
    ws.push_back(dw.p + (i % 3) * n * k);
    ys.push_back(dy.p + i * n);
    xs_h.push_back(x.data() + i * k);
    ws_h.push_back(w.data() + (i % 3) * n * k);
    ys_h.push_back(want.data() + i * n);
  }
  Dev<const bf16*> dxs(xs), dws(ws);
  Dev<bf16*> dys(ys);
  compute_->linear_batched(dxs.p, dws.p, dys.p, count, n, k);
  compute_->synchronize();
  ref::linear_batched(xs_h.data(), ws_h.data(), ys_h.data(), count, n, k);
  expect_close(dy.get(), want, "linear_batched");
}

TEST_F(GpuKernels, NormsEmbedSiluMatchReference) {
  const int rows = 5, hidden = 192, vocab = 11;
  auto a = rand_bf16(rows * hidden), b = rand_bf16(rows * hidden), g = rand_bf16(hidden);
  Dev<bf16> da(a), db(b), dg(g), dn(rows * hidden), ds(rows * hidden), dn2(rows * hidden);
  compute_->rmsnorm(da.p, dg.p, dn.p, rows, hidden, 1e-6f);
  compute_->add_rmsnorm(da.p, db.p, dg.p, ds.p, dn2.p, rows, hidden, 1e-6f);
  std::vector<bf16> n(rows * hidden), s(rows * hidden), n2(rows * hidden);
  ref::rmsnorm(a.data(), g.data(), n.data(), rows, hidden, 1e-6f);
  ref::add_rmsnorm(a.data(), b.data(), g.data(), s.data(), n2.data(), rows, hidden, 1e-6f);

  auto emb = rand_bf16(vocab * hidden), table = rand_bf16(4 * hidden);
  std::vector<std::int32_t> seq = {3, 1, 10, 2, 0, 12, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8};  // [5][4]
  std::vector<std::int32_t> pos = {2};
  Dev<bf16> demb(emb), dtable(table), de(rows * hidden);
  Dev<std::int32_t> dseq(seq), dpos(pos);
  compute_->embed(dseq.p, 4, dpos.p, demb.p, vocab, dtable.p, de.p, rows, hidden);
  std::vector<bf16> e(rows * hidden);
  ref::embed(seq.data(), 4, pos.data(), emb.data(), vocab, table.data(), e.data(), rows, hidden);

  Dev<bf16> dsm(rows * hidden / 2);
  compute_->silu_mul(da.p, dsm.p, rows, hidden / 2);
  std::vector<bf16> sm(rows * hidden / 2);
  ref::silu_mul(a.data(), sm.data(), rows, hidden / 2);
  compute_->synchronize();
  expect_close(dn.get(), n, "rmsnorm");
  expect_close(ds.get(), s, "add_rmsnorm sum");
  expect_close(dn2.get(), n2, "add_rmsnorm norm");
  EXPECT_EQ(de.get(), e) << "embed is a plain add: same bits";
  expect_close(dsm.get(), sm, "silu_mul");
}

TEST_F(GpuKernels, AttentionMatchesReferenceAtEveryPosition) {
  const int batch = 3, D = 64, S = 40;
  std::vector<bf16> kc(batch * S * D), vc(batch * S * D), kc_ref, vc_ref;
  Dev<bf16> dkc(kc.size()), dvc(vc.size()), dout(batch * D);
  kc_ref = kc;
  vc_ref = vc;
  for (int p = 0; p < S; ++p) {
    auto qkv = rand_bf16(batch * 3 * D);
    Dev<bf16> dqkv(qkv);
    Dev<std::int32_t> dpos(std::vector<std::int32_t>{p});
    compute_->attention_decode(dqkv.p, dkc.p, dvc.p, dpos.p, dout.p, batch, D, S);
    compute_->synchronize();
    std::vector<bf16> out(batch * D);
    ref::attention_decode(qkv.data(), kc_ref.data(), vc_ref.data(), &p, out.data(), batch, D, S);
    expect_close(dout.get(), out, "attention");
  }
  EXPECT_EQ(dkc.get(), kc_ref);
  EXPECT_EQ(dvc.get(), vc_ref);
}

TEST_F(GpuKernels, RoutingPointersAndArgmaxAreExact) {
  const int rows = 9, experts = 16, top_k = 4;
  std::uniform_real_distribution<float> u(-3, 3);
  std::vector<float> logits(rows * experts);
  for (auto& l : logits) l = u(rng_);
  logits[5] = logits[6];  // a tie
  Dev<float> dl(logits), dw(rows * top_k);
  Dev<std::int32_t> di(rows * top_k);
  compute_->router_topk(dl.p, rows, experts, top_k, di.p, dw.p);
  std::vector<std::int32_t> idx(rows * top_k);
  std::vector<float> w(rows * top_k);
  ref::router_topk(logits.data(), rows, experts, top_k, idx.data(), w.data());
  compute_->synchronize();
  EXPECT_EQ(di.get(), idx);
  auto gw = dw.get();
  for (std::size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(gw[i], w[i], 1e-5f);

  // Pointers from the routing: compare as offsets from their bases.
  const int count = rows * top_k, latent = 8, inter = 6;
  Dev<bf16> x(rows * latent), gu(count * 2 * inter), act(count * inter), y(count * latent), wts(experts * 100);
  std::vector<const bf16*> gut, dnt;
  for (int e = 0; e < experts; ++e) {
    gut.push_back(wts.p + e * 100);
    dnt.push_back(wts.p + e * 100 + 50);
  }
  Dev<const bf16*> dgut(gut), ddnt(dnt), a(count), b(count), d(count), e2(count);
  Dev<bf16*> c(count), f(count);
  ExpertPointers p{a.p, b.p, c.p, d.p, e2.p, f.p};
  compute_->expert_pointers(di.p, count, top_k, dgut.p, ddnt.p, experts, x.p, latent, gu.p, inter, act.p, y.p, p);
  compute_->synchronize();
  auto ga = a.get(), gb = b.get(), ge = e2.get();
  auto gc = c.get();
  for (int i = 0; i < count; ++i) {
    EXPECT_EQ(ga[i], x.p + (i / top_k) * latent);
    EXPECT_EQ(gb[i], gut[idx[i]]);
    EXPECT_EQ(ge[i], dnt[idx[i]]);
    EXPECT_EQ(gc[i], gu.p + i * 2 * inter);
  }

  const int batch = 4, vocab = 1000, S = 8;
  std::vector<float> lg(batch * vocab);
  for (auto& l : lg) l = u(rng_);
  lg[1 * vocab + 7] = 50.f;
  lg[1 * vocab + 900] = 50.f;  // tie: 7 wins
  lg[2 * vocab + 999] = 60.f;
  lg[3 * vocab + 0] = std::nanf("");
  std::vector<std::int32_t> seq(batch * S, -1), control = {4, 2};
  Dev<float> dlg(lg);
  Dev<std::int32_t> dseq(seq), dctl(control);
  compute_->argmax_next(dlg.p, batch, vocab, dseq.p, S, dctl.p, dctl.p + 1);
  compute_->advance(dctl.p);
  compute_->synchronize();
  ref::argmax_next(lg.data(), batch, vocab, seq.data(), S, control.data(), control.data() + 1);
  ref::advance(control.data());
  EXPECT_EQ(dseq.get(), seq);
  EXPECT_EQ(seq[1 * S + 5], 7);
  EXPECT_EQ(dctl.get(), control);
}

TEST_F(GpuKernels, CapturedGraphReplaysAtTheNextPosition) {
  std::vector<std::int32_t> pos = {0};
  Dev<std::int32_t> dpos(pos);
  auto graph = compute_->capture([&] { compute_->advance(dpos.p); });
  EXPECT_EQ(dpos.get()[0], 0) << "capturing runs nothing";
  for (int i = 0; i < 5; ++i) graph->replay();
  compute_->synchronize();
  EXPECT_EQ(dpos.get()[0], 5);
}

TEST_F(GpuKernels, TouchMatchesReferenceChecksum) {
  const std::size_t bytes = 3 << 20;
  void* p = compute_->outside_allocate(bytes);
  std::uint64_t got = compute_->touch(p, bytes, 99);
  compute_->outside_free(p, bytes);
  std::vector<std::uint64_t> host(bytes / 8);
  EXPECT_EQ(got, ref::touch(host.data(), bytes, 99));
}

}  // namespace
}  // namespace torpor::kernels
