// Backend choice, kill switches and the multicast decision of one device.
#include <gtest/gtest.h>

#include <cstdlib>

#include "ranks/multicast.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"

namespace torpor {
namespace {

// Sets an environment variable for one scope and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

const char* kill_switches[] = {"TORPOR_DISABLE_MULTICAST", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                               "NCCL_NVLS_ENABLE"};

struct ClearKillSwitches {
  ScopedEnv a{kill_switches[0], nullptr}, b{kill_switches[1], nullptr}, c{kill_switches[2], nullptr},
      d{kill_switches[3], nullptr};
};

TEST(Backend, ParseAndEnvironmentOverride) {
  EXPECT_EQ(parse_backend("host"), Backend::host);
  EXPECT_EQ(parse_backend("cuda"), Backend::cuda);
  EXPECT_EQ(parse_backend("auto"), Backend::automatic);
  EXPECT_THROW(parse_backend("tpu"), invalid_argument);
  ScopedEnv env("TORPOR_BACKEND", "host");
  DriverSelection sel = open_driver();
  EXPECT_EQ(sel.backend, Backend::host);
  EXPECT_EQ(sel.driver->backend_name(), "host");
  EXPECT_NE(sel.reason.find("TORPOR_BACKEND=host"), std::string::npos);
  ScopedEnv bad("TORPOR_BACKEND", "nonsense");
  EXPECT_THROW(open_driver(), invalid_argument);
}

TEST(Backend, CudaRequestedWithoutAGpuSaysWhy) {
  std::string why;
  DriverSelection automatic = open_driver(Backend::automatic, HostDriverOptions{});
  if (automatic.backend == Backend::cuda) GTEST_SKIP() << "a GPU is present; this checks the GPU-less path";
  try {
    open_driver(Backend::cuda, HostDriverOptions{});
    FAIL() << "expected an error";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda backend was requested"), std::string::npos) << e.what();
  }
  EXPECT_NE(automatic.reason.find("no usable GPU"), std::string::npos) << automatic.reason;
}

TEST(Backend, SizesParse) {
  EXPECT_EQ(parse_size("16G"), std::size_t{16} << 30);
  EXPECT_EQ(parse_size("512M"), std::size_t{512} << 20);
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_THROW(parse_size("12Q"), invalid_argument);
  EXPECT_THROW(parse_size("G"), invalid_argument);
}

TEST(MulticastPolicy, EachKillSwitchDisablesAndIsNamed) {
  ClearKillSwitches clear;
  HostDriver d;
  EXPECT_TRUE(probe_multicast(d, 0).usable);
  struct Case {
    const char* name;
    const char* value;
  } cases[] = {{"TORPOR_DISABLE_MULTICAST", "1"},
               {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
               {"NVSHMEM_DISABLE_NVLS", "1"},
               {"NCCL_NVLS_ENABLE", "0"}};
  for (const Case& c : cases) {
    ScopedEnv env(c.name, c.value);
    MulticastProbe p = probe_multicast(d, 0);
    EXPECT_FALSE(p.usable) << c.name;
    EXPECT_NE(p.reason.find(std::string(c.name) + "=" + c.value), std::string::npos) << p.reason;
  }
  // Values that do not disable.
  ScopedEnv off("TORPOR_DISABLE_MULTICAST", "0");
  ScopedEnv nccl_on("NCCL_NVLS_ENABLE", "1");
  EXPECT_TRUE(probe_multicast(d, 0).usable);
}

TEST(MulticastPolicy, AttributeOffIsTheReason) {
  ClearKillSwitches clear;
  HostDriverOptions o;
  o.multicast_attribute = false;
  HostDriver d(o);
  MulticastProbe p = probe_multicast(d, 0);
  EXPECT_FALSE(p.usable);
  EXPECT_NE(p.reason.find("MULTICAST_SUPPORTED = 0"), std::string::npos) << p.reason;
}

}  // namespace
}  // namespace torpor

#ifdef TORPOR_HAVE_CUDA
#include <dlfcn.h>

#include <thread>

#include "driver/cuda_driver.hpp"

namespace torpor {
namespace {

// A framework (PyTorch) keeps its current device as the thread's current context; a torpor
// call on another device must not leave that device current behind.
TEST(CudaDriver, LeavesTheCallersCurrentContextAlone) {
  std::string why;
  auto d = CudaDriver::open(&why);
  if (!d) GTEST_SKIP() << "no usable GPU: " << why;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr);
  using get_current_t = int (*)(void**);
  auto get_current = reinterpret_cast<get_current_t>(::dlsym(lib, "cuCtxGetCurrent"));
  ASSERT_NE(get_current, nullptr);
  std::thread([&] {
    void* before = reinterpret_cast<void*>(1);
    ASSERT_EQ(get_current(&before), 0);
    Stream s = d->stream_create(d->device_count() - 1);
    d->memory_info(0);
    device_ptr va = d->reserve(d->device_properties(0).granularity, 0);
    d->free_reservation(va, d->device_properties(0).granularity);
    d->stream_destroy(s);
    void* after = reinterpret_cast<void*>(1);
    ASSERT_EQ(get_current(&after), 0);
    EXPECT_EQ(after, before);
  }).join();
  ::dlclose(lib);
}

}  // namespace
}  // namespace torpor
#endif
