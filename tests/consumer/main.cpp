// Every installed header, so that a public header including an internal one fails here.
#include <torpor/torch_allocator.h>
#include <torpor/torpor.h>
#include <torpor/version.h>

#include <cstdio>
#include <cstring>
#include <torpor/backend.hpp>
#include <torpor/callback_group.hpp>
#include <torpor/collective_sleep.hpp>
#include <torpor/consensus.hpp>
#include <torpor/driver.hpp>
#include <torpor/error.hpp>
#include <torpor/group.hpp>
#include <torpor/hash128.hpp>
#include <torpor/host_driver.hpp>
#include <torpor/log.hpp>
#include <torpor/nccl_comm.hpp>
#include <torpor/nccl_group.hpp>
#include <torpor/pool.hpp>
#include <torpor/stream.hpp>
#include <torpor/symmetric.hpp>
#include <torpor/tags.hpp>
// torpor::kernels and torpor::fusion, exported too.
#include <torpor/fusion/tiny_moe.hpp>
#include <torpor/fusion/weights.hpp>
#include <torpor/kernels/moe_ops.hpp>
#include <torpor/kernels/tail_protocol.hpp>

int main() {
  auto sel = torpor::open_driver(torpor::Backend::host);
  torpor::Pool pool(*sel.driver);
  void* p = pool.allocate(1000, {torpor::tags::weights, torpor::MemoryClass::state, "x"});
  pool.sleep(1);
  pool.wake_up();
  pool.deallocate(p);
  // The library found is the one these headers belong to.
  if (std::strcmp(torpor_version(), TORPOR_VERSION) != 0) {
    std::printf("consumer: headers say %s, library says %s\n", TORPOR_VERSION, torpor_version());
    return 1;
  }
  // Something of torpor::fusion (and through it torpor::kernels) linked and run: prompts in range.
  constexpr int vocab = 97;
  auto prompts = torpor::fusion::make_prompts(7, 2, 5, vocab);
  for (auto t : prompts) {
    if (t < 0 || t >= vocab) {
      std::printf("consumer: prompt token %d outside [0, %d)\n", static_cast<int>(t), vocab);
      return 1;
    }
  }
  if (prompts.size() != 10) return 1;
  std::printf("consumer ok: %s, torpor %s\n", torpor_status_name(TORPOR_OK), torpor_version());
  return 0;
}
