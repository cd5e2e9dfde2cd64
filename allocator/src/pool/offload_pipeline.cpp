// The offload pipeline; the design note and invariants are in offload_pipeline.hpp.
#include "pool/offload_pipeline.hpp"

#include <chrono>
#include <thread>

#include "pool/host_copies.hpp"
#include "pool/sleep_plan.hpp"

namespace torpor {

void OffloadPipeline::issue(std::size_t k, Stream stream) {
  ChunkPlan& cp = plan_.chunks[k];
  bool copied = false;
  for (Piece& p : cp.pieces) {
    if (p.skip) {
      r_.bytes_skipped += p.bytes;
      continue;
    }
    offload_to_span(s_, p.span, cp.chunk->va + p.offset, p.bytes, stream, r_);
    r_.bytes_offloaded += p.bytes;
    copied = true;
  }
  if (!copied) return;  // nothing in flight reads the chunk: its worker releases it at once
  s_.driver.event_record(s_.events[k], stream);
  recorded_[k] = 1;
}

void OffloadPipeline::sample_copies(std::size_t k) {
  for (Piece& p : plan_.chunks[k].pieces) {
    if (p.skip) continue;                         // keeps the sample its retained copy had
    if (p.span.tier == HostTier::disk) continue;  // its addresses stand for a file extent: not readable
    p.sample = sample_of(p.span.ptr, p.bytes);
    p.sampled = true;
  }
}

void OffloadPipeline::release_loop() {
  while (auto k = issued_.pop()) {
    if (worker_failed_) continue;  // drain after a failure
    try {
      if (recorded_[*k]) {
        s_.driver.event_synchronize(s_.events[*k]);
        sample_copies(*k);
      }
      plan_.chunks[*k].chunk->unmap_and_release(s_.memory);  // a failed release is deferred
    } catch (...) {
      std::lock_guard lock(worker_mu_);
      if (!worker_error_) worker_error_ = std::current_exception();
      worker_failed_ = true;
      continue;
    }
    released_[*k] = 1;
  }
}

OffloadPipeline::~OffloadPipeline() { join_workers(); }

void OffloadPipeline::join_workers() noexcept {
  issued_.close();
  for (auto& w : workers_)
    if (w.joinable()) w.join();
}

void OffloadPipeline::start() {
  started_ = std::chrono::steady_clock::now();
  workers_.reserve(static_cast<std::size_t>(s_.options.release_threads));
  for (int i = 0; i < s_.options.release_threads; ++i) workers_.emplace_back([this] { release_loop(); });
  for (std::size_t k = 0; k < plan_.chunks.size(); ++k)
    if (plan_.chunks[k].pieces.empty()) issued_.push(k);
}

void OffloadPipeline::issue_groups() {
  double hash_seconds = 0;
  try {
    for (std::size_t first = 0; first < plan_.chunks.size() && !worker_failed_;) {
      const std::size_t last = hash_group_end(s_, plan_, first);
      hash_and_match(s_, plan_, first, last, r_, &hash_seconds);
      for (std::size_t k = first; k < last && !worker_failed_; ++k) {
        if (plan_.chunks[k].pieces.empty()) continue;  // queued by start()
        issue(k, s_.streams[k % s_.streams.size()]);
        issued_.push(k);
      }
      first = last;
    }
  } catch (...) {
    issue_error_ = std::current_exception();
  }
  if (hash_seconds > 0) r_.phases.push_back({"hash", hash_seconds});
}

void OffloadPipeline::finish(std::exception_ptr placing_failed) {
  if (placing_failed)
    issue_error_ = std::move(placing_failed);
  else
    issue_groups();
  join_workers();
  if (!error())
    r_.phases.push_back(
        {"offload_and_release", std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count()});
}

}  // namespace torpor
