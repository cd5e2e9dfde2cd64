// The NCCL loader's refusals (built where CMake found NCCL, TORPOR_NCCL).
#include <gtest/gtest.h>

#include <string>

#include "ranks/groups/nccl/nccl_library.hpp"
#include "torpor/nccl_group.hpp"

namespace torpor {
namespace {

TEST(NcclLibrary, MissingLibraryIsRefusedSayingWhy) {
  NcclLibrary lib = load_nccl_library("libtorpor-no-such-nccl.so.2");
  EXPECT_FALSE(lib.usable());
  EXPECT_EQ(lib.handle, nullptr);
  EXPECT_NE(lib.why_not.find("libtorpor-no-such-nccl.so.2 could not be loaded"), std::string::npos) << lib.why_not;
  EXPECT_NE(lib.why_not.find("TORPOR_NCCL_LIBRARY"), std::string::npos) << lib.why_not;
}

TEST(NcclLibrary, LibraryWithoutTheSymbolsIsRefusedNamingThem) {
  NcclLibrary lib = load_nccl_library("libc.so.6");
  EXPECT_FALSE(lib.usable());
  EXPECT_EQ(lib.handle, nullptr);
  EXPECT_EQ(lib.init_rank_config, nullptr);
  EXPECT_NE(lib.why_not.find("libc.so.6 lacks ncclGetVersion, ncclGetUniqueId"), std::string::npos) << lib.why_not;
}

TEST(NcclLibrary, NcclGroupSaysWhatTheLoaderSays) {
  std::string why;
  const bool available = NcclGroup::available(&why);
  EXPECT_EQ(available, nccl_library().usable());
  if (available) {
    EXPECT_GT(nccl_library().version, 0);
  } else {
    EXPECT_EQ(why, nccl_library().why_not);
  }
}

}  // namespace
}  // namespace torpor
