// Probe: cost of cuMemHostRegister per call vs block size, hugepage-backed memory, 16-thread populate.
#include <cuda.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
using clk = std::chrono::steady_clock;
static double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }
#define CK(x)                         \
  do {                                \
    CUresult r = (x);                 \
    if (r != CUDA_SUCCESS) {          \
      const char* s;                  \
      cuGetErrorString(r, &s);        \
      std::printf("%s: %s\n", #x, s); \
      std::exit(1);                   \
    }                                 \
  } while (0)
static char* map_region(size_t bytes) {
  void* p = mmap(nullptr, bytes + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char* b = (char*)(((uintptr_t)p + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1));
  madvise(b, bytes, MADV_HUGEPAGE);
  return b;
}
static void populate(char* b, size_t bytes, int threads) {
  std::atomic<size_t> next{0};
  const size_t slice = 16 << 20;
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i)
    ts.emplace_back([&] {
      for (size_t o; (o = next.fetch_add(slice)) < bytes;)
        madvise(b + o, std::min(slice, bytes - o), MADV_POPULATE_WRITE);
    });
  for (auto& t : ts) t.join();
}
int main() {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  const size_t total = size_t(16) << 30;
  for (size_t block : {size_t(256) << 20, size_t(1) << 30, size_t(4) << 30, total}) {
    char* b = map_region(total);
    auto t = clk::now();
    populate(b, total, 16);
    double tp = since(t);
    t = clk::now();
    double worst = 0;
    for (size_t o = 0; o < total; o += block) {
      auto t1 = clk::now();
      CK(cuMemHostRegister(b + o, block, 0));
      worst = std::max(worst, since(t1));
    }
    double tr = since(t);
    std::printf("16 GiB: populate %.3f s (%.1f GB/s); register in %zu MiB blocks: %.3f s (%.1f GB/s, %zu calls, worst "
                "call %.1f ms)\n",
                tp, total / tp / 1e9, block >> 20, tr, total / tr / 1e9, total / block, worst * 1e3);
    for (size_t o = 0; o < total; o += block) CK(cuMemHostUnregister(b + o));
    munmap(b, total);
  }
  // Interference: D2H copies of 64 MiB pieces into a registered 4 GiB buffer while another thread registers 16 GiB in
  // 256 MiB blocks.
  CUdeviceptr d;
  const size_t cb = size_t(4) << 30;
  CK(cuMemAlloc(&d, cb));
  char* h = map_region(cb);
  populate(h, cb, 16);
  CK(cuMemHostRegister(h, cb, 0));
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  auto copy_all = [&] {
    auto t = clk::now();
    for (size_t o = 0; o < cb; o += 64 << 20) CK(cuMemcpyDtoHAsync(h + o, d + o, 64 << 20, s));
    CK(cuStreamSynchronize(s));
    return since(t);
  };
  double alone = copy_all();
  char* b = map_region(total);
  populate(b, total, 16);
  std::atomic<bool> done{false};
  double treg = 0;
  std::thread reg([&] {
    CK(cuCtxSetCurrent(ctx));
    auto t = clk::now();
    for (size_t o = 0; o < total; o += 256 << 20) CK(cuMemHostRegister(b + o, 256 << 20, 0));
    treg = since(t);
    done = true;
  });
  int rounds = 0;
  auto t = clk::now();
  while (!done) {
    copy_all();
    ++rounds;
  }
  double busy = since(t);
  reg.join();
  std::printf(
      "4 GiB D2H alone %.3f s (%.1f GB/s); during 16 GiB registration (%.3f s): %d rounds in %.3f s (%.1f GB/s)\n",
      alone, cb / alone / 1e9, treg, rounds, busy, rounds * cb / busy / 1e9);
  return 0;
}
