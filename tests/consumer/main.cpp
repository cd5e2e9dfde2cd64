#include <torpor/backend.hpp>
#include <torpor/pool.hpp>
#include <torpor/torpor.h>

#include <cstdio>

int main() {
  auto sel = torpor::open_driver(torpor::Backend::host);
  torpor::Pool pool(*sel.driver);
  void* p = pool.allocate(1000, {"weights", torpor::MemoryClass::state, "x"});
  pool.sleep(1);
  pool.wake_up();
  pool.deallocate(p);
  std::printf("consumer ok: %s\n", torpor_status_name(TORPOR_OK));
  return 0;
}
