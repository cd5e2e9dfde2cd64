// Dummy weights from a seed, reproducible element by element.
//
// Every logical (unsharded) tensor has a name; element i of it is a pure function of
// (version, name, i), so a rank generates exactly its shard without generating the rest, every
// rank count sees the same logical model, and a reload after a level-2 sleep writes the same
// bits as the first load. An RL update is modelled as a seeded perturbation: version `updates`
// (> 0) adds update_scale * noise(update_seed, updates, name, i) to the base value, so a freshly
// built model loading the same version gets the same bits, consecutive versions differ by at most
// twice update_scale, and a version costs the same to generate however many came before (a soak
// loads hundreds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace torpor::fusion {

struct WeightVersion {
  std::uint64_t seed = 1234;
  std::uint64_t update_seed = 0;
  int updates = 0;
  float update_scale = 0.05f;  // relative to the tensor's scale
};

// FNV-1a of the name: the tensor's identity in the hash.
std::uint64_t weight_name_hash(std::string_view name) noexcept;
// Uniform in [-1, 1), from (seed, name hash, index).
float weight_uniform(std::uint64_t seed, std::uint64_t name_hash, std::uint64_t index) noexcept;
// The element's value before scaling: base uniform plus the version's perturbation.
float weight_value(const WeightVersion& v, std::uint64_t name_hash, std::uint64_t index) noexcept;

// Deterministic prompts: batch x prompt_len tokens in [0, vocab), row-major.
std::vector<std::int32_t> make_prompts(std::uint64_t seed, int batch, int prompt_len, int vocab);

}  // namespace torpor::fusion
