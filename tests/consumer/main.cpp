// Every installed header, so that a public header including an internal one fails here.
#include <torpor/torch_allocator.h>
#include <torpor/torpor.h>

#include <cstdio>
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

int main() {
  auto sel = torpor::open_driver(torpor::Backend::host);
  torpor::Pool pool(*sel.driver);
  void* p = pool.allocate(1000, {torpor::tags::weights, torpor::MemoryClass::state, "x"});
  pool.sleep(1);
  pool.wake_up();
  pool.deallocate(p);
  std::printf("consumer ok: %s\n", torpor_status_name(TORPOR_OK));
  return 0;
}
