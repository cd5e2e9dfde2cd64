// Dummy weights (weights.hpp): splitmix64 over (seed, name hash, index).
#include "torpor/fusion/weights.hpp"

#include <algorithm>

namespace torpor::fusion {

namespace {

std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

std::uint64_t weight_name_hash(std::string_view name) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

float weight_uniform(std::uint64_t seed, std::uint64_t name_hash, std::uint64_t index) noexcept {
  std::uint64_t h = mix(mix(seed ^ mix(name_hash)) ^ index);
  // 24 random bits -> [0, 1) exactly representable, then [-1, 1).
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
}

float weight_value(const WeightVersion& v, std::uint64_t name_hash, std::uint64_t index) noexcept {
  float x = weight_uniform(v.seed, name_hash, index);
  if (v.updates > 0)
    x += v.update_scale *
         weight_uniform(mix(v.update_seed + 0x5bd1e995ull * static_cast<std::uint64_t>(v.updates)), name_hash, index);
  return x;
}

std::vector<std::int32_t> make_prompts(std::uint64_t seed, int batch, int prompt_len, int vocab) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(batch) * static_cast<std::size_t>(prompt_len));
  const std::uint64_t h = weight_name_hash("prompts");
  for (std::size_t i = 0; i < out.size(); ++i) {
    float u = (weight_uniform(seed, h, i) + 1.0f) * 0.5f;  // [0, 1)
    out[i] = std::min(vocab - 1, static_cast<int>(u * static_cast<float>(vocab)));
  }
  return out;
}

}  // namespace torpor::fusion
