// A stand-in for libFuzzer's main where the compiler has none (g++): runs the fuzz target on
// every file of the corpus directories given, then on inputs made from them by seeded random
// mutation (byte flips, insertions, truncations, splices) and on fresh random bytes, until
// -max_total_time seconds or -runs inputs. It keeps no coverage and writes nothing: what it finds
// is a crash or a sanitizer report; -seed=N with the same corpus reproduces a run.
//   torpor_fuzz_X [-max_total_time=S] [-runs=N] [-seed=N] [DIR_OR_FILE ...]
// Unknown -flags (libFuzzer's others) are ignored, so one command line drives either build.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

using Bytes = std::vector<std::uint8_t>;

Bytes read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

Bytes mutate(Bytes b, const std::vector<Bytes>& corpus, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 8);
  for (int i = 0; i < edits; ++i) {
    switch (rng() % 5) {
      case 0:
        if (!b.empty()) b[rng() % b.size()] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
        break;
      case 1:
        if (!b.empty()) b[rng() % b.size()] = static_cast<std::uint8_t>(rng());
        break;
      case 2:
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(b.empty() ? 0 : rng() % b.size()),
                 static_cast<std::uint8_t>(rng()));
        break;
      case 3:
        if (!b.empty()) b.resize(rng() % b.size());
        break;
      default:
        if (!corpus.empty()) {
          const Bytes& o = corpus[rng() % corpus.size()];
          if (!o.empty()) {
            const std::size_t at = rng() % o.size();
            b.insert(b.end(), o.begin() + static_cast<std::ptrdiff_t>(at), o.end());
          }
        }
    }
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  double max_seconds = 10;
  long long runs = -1;
  std::uint64_t seed = 1;
  std::vector<Bytes> corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("-max_total_time=", 0) == 0) {
      max_seconds = std::atof(a.c_str() + 16);
    } else if (a.rfind("-runs=", 0) == 0) {
      runs = std::atoll(a.c_str() + 6);
    } else if (a.rfind("-seed=", 0) == 0) {
      seed = std::strtoull(a.c_str() + 6, nullptr, 10);
    } else if (a[0] == '-') {
      continue;
    } else if (std::filesystem::is_directory(a)) {
      for (const auto& e : std::filesystem::directory_iterator(a))
        if (e.is_regular_file()) corpus.push_back(read_file(e.path()));
    } else if (std::filesystem::is_regular_file(a)) {
      corpus.push_back(read_file(a));
    }
  }
  for (const Bytes& b : corpus) LLVMFuzzerTestOneInput(b.data(), b.size());
  std::fprintf(stderr, "random driver: %zu corpus inputs ran; mutating with seed %llu\n", corpus.size(),
               static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(max_seconds);
  long long n = 0;
  for (; (runs < 0 || n < runs) && std::chrono::steady_clock::now() < end; ++n) {
    Bytes b;
    if (!corpus.empty() && rng() % 4 != 0) {
      b = mutate(corpus[rng() % corpus.size()], corpus, rng);
    } else {
      b.resize(rng() % 512);
      for (auto& x : b) x = static_cast<std::uint8_t>(rng());
    }
    LLVMFuzzerTestOneInput(b.data(), b.size());
  }
  std::fprintf(stderr, "random driver: %lld inputs, no crash\n", n);
  return 0;
}
