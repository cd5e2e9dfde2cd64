// Timing helpers the benches share: a steady clock, seconds since a point, the median of samples.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace torpor::bench {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// 0 for no samples; the mean of the middle two for an even count.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace torpor::bench
