// Content hash of a byte range: 128 bits, computed on the device at HBM speed (the CUDA
// kernel in src/driver/cuda/content_hash.cu) or on the CPU (HostDriver, tests), with identical results.
//
// Definition. Split the range into 8-byte little-endian words w_0 .. w_{m-1} (the last one
// zero-padded). Each word is mixed with its index by two different bijective 64-bit mixers
// (splitmix64 and murmur3's fmix64 finalizers over word ^ keyed index); the two lanes are
// the sums of the mixed words mod 2^64, finalized with the byte count. A sum is exact in any
// order, so thousands of GPU threads can accumulate it with atomics and still agree bit for
// bit with the CPU. Any change of a single word always changes lane a (the mixer is a
// bijection for a fixed index); reordering words changes it too (the index is keyed in).
// This guards against accidental change (the skip-unchanged-bytes optimisation), not
// against an adversary.
//
// Internal (allocator/internal/include: in-tree targets see it, the install does not); the
// public type is Hash128 (hash128.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "torpor/hash128.hpp"
#include "torpor/host_device.hpp"

namespace torpor {

namespace content_hash {

TORPOR_HD std::uint64_t lane_a(std::uint64_t word, std::uint64_t index) {
  std::uint64_t z = word ^ ((index + 1) * 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

TORPOR_HD std::uint64_t lane_b(std::uint64_t word, std::uint64_t index) {
  std::uint64_t z = word + (index + 1) * 0xD6E8FEB86659FD93ULL;
  z = (z ^ (z >> 33)) * 0xFF51AFD7ED558CCDULL;
  z = (z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53ULL;
  return z ^ (z >> 33);
}

TORPOR_HD Hash128 finalize(std::uint64_t sum_a, std::uint64_t sum_b, std::uint64_t bytes) {
  return Hash128{lane_a(sum_a, bytes), lane_b(sum_b, bytes ^ 0x5851F42D4C957F2DULL)};
}

// The CPU reference.
inline Hash128 compute(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t a = 0, b = 0;
  std::size_t words = bytes / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    a += lane_a(w, i);
    b += lane_b(w, i);
  }
  if (std::size_t tail = bytes % 8; tail != 0) {
    std::uint64_t w = 0;
    std::memcpy(&w, p + 8 * words, tail);
    a += lane_a(w, words);
    b += lane_b(w, words);
  }
  return finalize(a, b, bytes);
}

}  // namespace content_hash
}  // namespace torpor
