// HostCompute: the host backend's Compute. Every op is the CPU reference kernel run in place on
// pool memory (HostDriver maps device memory at CPU addresses), finished before the call
// returns, so synchronize() has nothing to wait for and there are no graphs: a decode step is
// simply run again. Touching a sleeping address faults here as on a GPU, so a step that runs
// while its tags sleep is caught.
#include <fmt/core.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "compute/compute_impl.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion {

namespace {

namespace ref = kernels::ref;

class HostCompute final : public Compute {
 public:
  HostCompute(Driver& driver, int device) : driver_(driver), device_(device), stream_(driver.stream_create(device)) {}
  ~HostCompute() override {
    try {
      driver_.stream_destroy(stream_);
    } catch (const std::exception& e) {
      log::error("host compute (device {}): destroying its stream failed: {}", device_, e.what());
    }
  }

  std::string_view backend() const noexcept override { return "host"; }
  int device() const noexcept override { return device_; }
  Stream stream() const noexcept override { return stream_; }

  void linear(const bf16* x, const bf16* w, bf16* y, int m, int n, int k) override { ref::linear(x, w, y, m, n, k); }
  void linear(const bf16* x, const bf16* w, float* y, int m, int n, int k) override { ref::linear(x, w, y, m, n, k); }
  void linear_batched(const bf16* const* x, const bf16* const* w, bf16* const* y, int count, int n, int k) override {
    ref::linear_batched(x, w, y, count, n, k);
  }
  void embed(const std::int32_t* seq, int seq_stride, const std::int32_t* pos, const bf16* tok_emb, int vocab,
             const bf16* pos_table, bf16* out, int batch, int hidden) override {
    ref::embed(seq, seq_stride, pos, tok_emb, vocab, pos_table, out, batch, hidden);
  }
  void rmsnorm(const bf16* x, const bf16* gamma, bf16* out, int rows, int hidden, float eps) override {
    ref::rmsnorm(x, gamma, out, rows, hidden, eps);
  }
  void add_rmsnorm(const bf16* a, const bf16* b, const bf16* gamma, bf16* sum_out, bf16* norm_out, int rows, int hidden,
                   float eps) override {
    ref::add_rmsnorm(a, b, gamma, sum_out, norm_out, rows, hidden, eps);
  }
  void attention_decode(const bf16* qkv, bf16* k_cache, bf16* v_cache, const std::int32_t* pos, bf16* out, int batch,
                        int head_dim, int max_seq) override {
    ref::attention_decode(qkv, k_cache, v_cache, pos, out, batch, head_dim, max_seq);
  }
  void router_topk(const float* logits, int rows, int experts, int top_k, std::int32_t* idx, float* weights) override {
    ref::router_topk(logits, rows, experts, top_k, idx, weights);
  }
  void silu_mul(const bf16* in, bf16* out, int rows, int inter) override { ref::silu_mul(in, out, rows, inter); }
  void expert_pointers(const std::int32_t* idx, int count, int top_k, const bf16* const* gate_up_table,
                       const bf16* const* down_table, int experts, const bf16* x_lat, int latent, bf16* gate_up_out,
                       int inter, bf16* act, bf16* y_lat, const kernels::ExpertPointers& out) override {
    ref::expert_pointers(idx, count, top_k, gate_up_table, down_table, experts, x_lat, latent, gate_up_out, inter, act,
                         y_lat, out);
  }
  void argmax_next(const float* logits, int batch, int vocab, std::int32_t* seq, int seq_stride,
                   const std::int32_t* pos, const std::int32_t* prompt_len) override {
    ref::argmax_next(logits, batch, vocab, seq, seq_stride, pos, prompt_len);
  }
  void advance(std::int32_t* pos) override { ref::advance(pos); }

  void synchronize() override { driver_.stream_synchronize(stream_); }

  GraphAllocatorBytes graph_allocator_bytes() override { return {}; }
  bool graphs() const noexcept override { return false; }
  std::unique_ptr<Graph> capture(const std::function<void()>&) override {
    throw unavailable("host compute: CUDA graphs need the cuda backend (the host backend runs each step directly)");
  }

  std::size_t workspace_bytes() const noexcept override { return 0; }
  void set_workspace(void*, std::size_t) override {}

  void* outside_allocate(std::size_t bytes) override {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw out_of_memory(
          fmt::format("host compute: mmap of {} bytes outside the pool failed: {}", bytes, std::strerror(errno)));
    return p;
  }
  void outside_free(void* p, std::size_t bytes) noexcept override {
    if (p != nullptr && ::munmap(p, bytes) != 0) log::error("host compute: munmap of {} bytes failed", bytes);
  }
  std::uint64_t touch(void* p, std::size_t bytes, std::uint64_t seed) override { return ref::touch(p, bytes, seed); }

 private:
  Driver& driver_;
  int device_;
  Stream stream_;
};

}  // namespace

std::unique_ptr<Compute> make_host_compute(Driver& driver, int device) {
  return std::make_unique<HostCompute>(driver, device);
}

}  // namespace torpor::fusion
