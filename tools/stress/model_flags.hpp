// What `torpor stress` and `torpor rl-loop` share: the tiny model's size flags, and one rank's
// engine (pool, symmetric heap, compute, model) built from them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "launch/launch.hpp"
#include "torpor/fusion/compute.hpp"
#include "torpor/fusion/tiny_moe.hpp"
#include "torpor/group.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::cli {

struct ModelFlags {
  fusion::TinyMoeConfig config;  // max_batch and max_seq follow prompts / prompt_len + new_tokens
  int prompts = 16;
  int prompt_len = 8;
  int new_tokens = 48;
  std::uint64_t seed = 1234;
  int wait_timeout_ms = 5000;
  bool no_graphs = false;
  bool unfused = false;  // TailOptions::allow_fused = false: the default (unfused) tail path

  fusion::TinyMoeConfig model_config() const;
  fusion::TinyMoeOptions model_options() const;
  // The flags as a worker command line (processes re-run the same command).
  std::vector<std::string> args() const;
};

// One rank's engine. Members are destroyed model first, pool last.
struct RankEngine {
  RankEngine(Driver& driver, Group& group, int device, const ModelFlags& flags, FillOnWake fill,
             const std::vector<std::string>& preserve, const fusion::WeightVersion& version);
  Pool pool;
  SymmetricHeap heap;
  std::unique_ptr<fusion::Compute> compute;
  std::unique_ptr<fusion::TinyMoeLM> model;
};

// Tokens that differ between two outputs of [prompts][new_tokens], and prompts that match fully.
struct Comparison {
  int matching_prompts = 0;
  std::size_t mismatched_tokens = 0;
};
Comparison compare_outputs(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b, int prompts);

// FNV-1a of the tokens, as 16 hex digits (cross-rank comparison of outputs).
std::string digest(const std::vector<std::int32_t>& tokens);

// Every rank contributes its error text ("" = fine); throws error naming every failed rank when
// any did. Everyone calls it after each step that can fail on some ranks only, so no rank waits
// in a later collective for a rank that already gave up.
void agree_on_failures(Group& group, const std::string& step, const std::string& mine);

}  // namespace torpor::cli
