// The offload pipeline; the design note and invariants are in offload_pipeline.hpp.
#include "pool/offload_pipeline.hpp"

#include <chrono>
#include <thread>

#include "pool/host_copies.hpp"

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

void OffloadPipeline::run() {
  auto t = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(s_.options.release_threads));
  for (int i = 0; i < s_.options.release_threads; ++i) workers.emplace_back([this] { release_loop(); });
  for (std::size_t k = 0; k < plan_.chunks.size() && !worker_failed_; ++k) {
    try {
      issue(k, s_.streams[k % s_.streams.size()]);
    } catch (...) {
      issue_error_ = std::current_exception();
      break;
    }
    issued_.push(k);
  }
  issued_.close();
  for (auto& w : workers) w.join();
  if (!error())
    r_.phases.push_back(
        {"offload_and_release", std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count()});
}

}  // namespace torpor
