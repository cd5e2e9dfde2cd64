// ReferenceTailOps: the tail on the CPU reference (kernels/reference/tail_reference.cpp), for
// drivers whose compute is the CPU reference (the host backend). Pool memory is the CPU's, so
// every call runs on the calling thread, in place, and has finished when it returns; there is no
// stream to wait for. The multicast variant stores through the driver's software fan-out
// (Driver::multicast_store), which exists where capabilities().multicast is emulated.
#include <fmt/core.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "tail/tail_ops.hpp"
#include "torpor/error.hpp"
#include "torpor/group.hpp"
#include "torpor/kernels/tail_reference.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::fusion::detail {

namespace {

class ReferenceTailOps final : public TailOps {
 public:
  ReferenceTailOps(SymmetricHeap& heap, TailName who)
      : driver_(heap.pool().driver()), group_(heap.group()), who_(std::move(who)) {}

  bool synchronous() const noexcept override { return true; }
  void check_stream(Stream) const override {}  // nothing is enqueued: any stream will do

  FusedSupport fused_support() override {
    FusedSupport s;
    const auto multicast = driver_.capabilities().multicast;
    if (multicast != DriverCapabilities::Multicast::emulated)
      s.multicast_why_not =
          fmt::format("the host multicast emulation is out of reach (the {} driver reports multicast: {})",
                      driver_.backend_name(), to_string(multicast));
    return s;
  }

  std::string prepare_fused(bool multicast) override {
    if (!multicast) return "";
    if (driver_.capabilities().multicast != DriverCapabilities::Multicast::emulated)
      throw unavailable(fmt::format("the host multicast emulation is out of reach (the {} driver has no multicast "
                                    "fan-out store)",
                                    driver_.backend_name()));
    hooks_.multicast_store = [&driver = driver_](std::uint64_t va, const void* src, std::size_t n) {
      driver.multicast_store(static_cast<device_ptr>(va), src, n);
    };
    return "";
  }
  FusedLaunch fused_launch() const noexcept override { return {}; }
  void fused(const kernels::TailParams& p, Stream) override { kernels::reference_tail_fused(p, hooks_); }

  kernels::TailControl read_control(const void* control) override {
    kernels::TailControl c{};
    std::memcpy(&c, control, sizeof c);  // only this rank's thread writes it
    return c;
  }
  void initialise(void* slots, std::size_t elements, void* control, const kernels::TailControl& fresh,
                  std::uint32_t* abort) override {
    kernels::reference_fill_sentinel(static_cast<bf16*>(slots), elements);
    std::memcpy(control, &fresh, sizeof fresh);
    std::atomic_ref<std::uint32_t>(*abort).store(0u, std::memory_order_release);
  }
  void wait_idle() override {}  // every call finished when it returned

  void prepare_unfused() override {}
  void unfused(const kernels::TailParams& p, Stream) override {
    const std::size_t elements = static_cast<std::size_t>(p.tokens) * static_cast<std::size_t>(p.hidden);
    std::vector<bf16> partial(elements);
    kernels::reference_finalize(p, partial.data());
    auto all = group_.all_gather(std::as_bytes(std::span<const bf16>(partial)));
    std::vector<float> sum(elements);
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r].size() != elements * sizeof(bf16))
        throw invalid_argument(fmt::format("{}: rank {} sent {} bytes of partials, this rank expected {} ({} tokens): "
                                           "every rank must pass the same TailArgs::tokens",
                                           who_(), r, all[r].size(), elements * sizeof(bf16), p.tokens));
      const auto* b = reinterpret_cast<const std::uint16_t*>(all[r].data());
      for (std::size_t i = 0; i < elements; ++i) {
        const float f = kernels::tail_bf16_to_float(b[i]);
        sum[i] = r == 0 ? f : kernels::tail_add(sum[i], f);
      }
    }
    kernels::reference_residual_norm(p, sum.data());
  }
  void check_unfused() override {}  // the all-gather throws what goes wrong

  void release() noexcept override {}

 private:
  Driver& driver_;
  Group& group_;
  TailName who_;
  kernels::ReferenceHooks hooks_;
};

}  // namespace

std::unique_ptr<TailOps> make_reference_tail_ops(SymmetricHeap& heap, const TailShape&, const TailOptions&,
                                                 TailName who) {
  return std::make_unique<ReferenceTailOps>(heap, std::move(who));
}

}  // namespace torpor::fusion::detail
