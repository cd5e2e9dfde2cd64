// bf16 on the host: the same 16 bits as CUDA's __nv_bfloat16, so device buffers and CPU
// reference buffers hold identical bytes. Conversion from float rounds to nearest even (as
// __float2bfloat16_rn); NaN stays NaN. -0.0 is 0x8000: the Lamport protocol's sentinel.
#pragma once

#include <cstdint>
#include <cstring>

namespace torpor {

struct bf16 {
  std::uint16_t bits = 0;

  static constexpr bf16 from_bits(std::uint16_t b) noexcept { return bf16{b}; }
  static bf16 from_float(float f) noexcept {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0)
      return bf16{static_cast<std::uint16_t>((u >> 16) | 0x40)};
    u += 0x7FFFu + ((u >> 16) & 1u);
    return bf16{static_cast<std::uint16_t>(u >> 16)};
  }
  float to_float() const noexcept {
    std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  friend bool operator==(bf16 a, bf16 b) noexcept { return a.bits == b.bits; }
};
static_assert(sizeof(bf16) == 2);

inline constexpr bf16 bf16_negative_zero = bf16::from_bits(0x8000);  // the Lamport sentinel

}  // namespace torpor
