// IndexQueue: hands indices (of planned chunks, of wake groups) from one thread to workers.
// A push happens-before the pop that returns it, so what the producer wrote about an index
// before pushing it is visible to the consumer. close() ends the stream: pop() then drains
// what is left and returns nothing.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>

namespace torpor {

class IndexQueue {
 public:
  void push(std::size_t i) {
    {
      std::lock_guard lock(mu_);
      items_.push_back(i);
    }
    cv_.notify_one();
  }
  void close() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }
  // Next index, or nothing once closed and drained.
  std::optional<std::size_t> pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return std::nullopt;
    std::size_t i = items_.front();
    items_.pop_front();
    return i;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::size_t> items_;
  bool closed_ = false;
};

}  // namespace torpor
