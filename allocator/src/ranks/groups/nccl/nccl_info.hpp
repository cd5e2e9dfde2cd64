// What the process's NCCL is, for reports (`torpor doctor`), without nccl.h: the loader
// (nccl_library.hpp) fills it in a build with NCCL support; nccl_info_unavailable.cpp says the
// build has none. Loads NCCL on first call, like the loader (never unloaded).
#pragma once

#include <string>

namespace torpor {

struct NcclInfo {
  bool built = false;         // this build has NCCL support (TORPOR_NCCL)
  bool usable = false;        // the library loaded with every symbol torpor needs
  std::string name;           // the file opened (TORPOR_NCCL_LIBRARY or libnccl.so.2)
  std::string why_not;        // when not usable
  int version = 0;            // ncclGetVersion: 22809 for 2.28.9
  bool comm_suspend = false;  // ncclCommSuspend and ncclCommResume are present (NCCL 2.29.7 and later)
};

NcclInfo nccl_info();

}  // namespace torpor
