// The options table: every environment variable torpor reads, parsed and validated in one place.
// Oracles: the accepted ranges and defaults as the configuration reference
// (docs/reference/configuration.md) and the public headers state them, and that reference's table
// of environment variables itself.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/options.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"
#include "torpor/group.hpp"
#include "torpor/log.hpp"

namespace torpor {
namespace {

using namespace std::chrono_literals;

// Sets (or unsets, with nullptr) an environment variable for one scope.
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

// The message of the invalid_argument `f` throws ("" and a test failure when it does not).
template <typename F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected invalid_argument";
  return "";
}

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

TEST(Options, DefaultsWhenUnsetOrEmpty) {
  ScopedEnv a("TORPOR_LOG", nullptr), b("TORPOR_BACKEND", ""), c("TORPOR_HOST_DEVICES", nullptr),
      d("TORPOR_HOST_DEVICE_MEMORY", ""), e("TORPOR_GROUP_TIMEOUT_MS", nullptr), f("TORPOR_RANK", ""),
      g("TORPOR_NCCL_LIBRARY", ""), h("TMPDIR", nullptr);
  EXPECT_EQ(options::log_level(), log::level::warn);
  EXPECT_EQ(options::backend(), "auto");
  EXPECT_EQ(backend_from_env(), Backend::automatic);
  EXPECT_EQ(options::host_devices(), 8);
  EXPECT_EQ(options::host_device_memory(), std::size_t{16} << 30);
  EXPECT_EQ(default_group_timeout(), 60s);
  EXPECT_EQ(options::rank(), std::nullopt);
  EXPECT_EQ(options::nccl_library(), "libnccl.so.2");
  EXPECT_EQ(options::tmpdir(), "/tmp");
  // The table's defaults are the ones the public structs start from.
  HostDriverOptions defaults;
  HostDriverOptions from_env = host_driver_options_from_env();
  EXPECT_EQ(from_env.devices, defaults.devices);
  EXPECT_EQ(from_env.device_bytes, defaults.device_bytes);
}

TEST(Options, LogLevelsInAnyCaseAndOff) {
  const std::pair<const char*, log::level> cases[] = {{"off", log::level::off},     {"OFF", log::level::off},
                                                      {"error", log::level::error}, {"Error", log::level::error},
                                                      {"warn", log::level::warn},   {"WARN", log::level::warn},
                                                      {"info", log::level::info},   {"iNfO", log::level::info},
                                                      {"debug", log::level::debug}, {"DEBUG", log::level::debug}};
  for (auto [text, level] : cases) {
    ScopedEnv env("TORPOR_LOG", text);
    EXPECT_EQ(options::log_level(), level) << text;
  }
}

TEST(Options, UnknownLogLevelIsRefusedNamingTheLevels) {
  ScopedEnv env("TORPOR_LOG", "verbose");
  const std::string what = refusal([] { options::log_level(); });
  EXPECT_TRUE(contains(what, "TORPOR_LOG='verbose'")) << what;
  EXPECT_TRUE(contains(what, "off, error, warn, info, debug")) << what;
}

TEST(Options, LevelOffSilencesEveryMessage) {
  const log::level before = log::current_level();
  log::set_level(log::level::off);
  testing::internal::CaptureStderr();
  log::error("an error nobody should see");
  log::warn("a warning nobody should see");
  const std::string silenced = testing::internal::GetCapturedStderr();
  log::set_level(log::level::error);
  testing::internal::CaptureStderr();
  log::error("an error everybody sees");
  const std::string shown = testing::internal::GetCapturedStderr();
  log::set_level(before);
  EXPECT_EQ(silenced, "");
  EXPECT_TRUE(contains(shown, "torpor error: an error everybody sees")) << shown;
}

TEST(Options, BackendInAnyCaseAndUnknownNamed) {
  {
    ScopedEnv env("TORPOR_BACKEND", "HOST");
    EXPECT_EQ(backend_from_env(), Backend::host);
    EXPECT_EQ(open_driver().backend, Backend::host);
  }
  ScopedEnv env("TORPOR_BACKEND", "tpu");
  const std::string what = refusal([] { backend_from_env(); });
  EXPECT_TRUE(contains(what, "TORPOR_BACKEND='tpu'")) << what;
  EXPECT_TRUE(contains(what, "auto, host, cuda")) << what;
  EXPECT_THROW(open_driver(), invalid_argument);
}

// torch_memory_saver's switches (csrc/utils.h get_bool_env_var at 4a43c97): 1, true, yes on, 0,
// false, no off, anything else refused (TMS exits); its backend is pinned unless mmap.
TEST(Options, TorchMemorySaverSwitchesTakeItsValues) {
  using options::id;
  EXPECT_FALSE(options::tms_switch(id::tms_init_enable)) << "unset: off";
  for (const char* on : {"1", "true", "TRUE", "yes", "YES"}) {
    ScopedEnv env("TMS_INIT_ENABLE", on);
    EXPECT_TRUE(options::tms_switch(id::tms_init_enable)) << on;
  }
  for (const char* off : {"0", "false", "NO"}) {
    ScopedEnv env("TMS_RETAIN_CPU_BACKUP", off);
    EXPECT_FALSE(options::tms_switch(id::tms_retain_cpu_backup)) << off;
  }
  {
    ScopedEnv env("TMS_INIT_ENABLE_CPU_BACKUP", "2");
    const std::string what = refusal([] { options::tms_switch(id::tms_init_enable_cpu_backup); });
    EXPECT_TRUE(contains(what, "TMS_INIT_ENABLE_CPU_BACKUP='2'")) << what;
  }
  EXPECT_EQ(options::tms_cpu_backup_backend(), "pinned");
  ScopedEnv mmap("TMS_INIT_CPU_BACKUP_BACKEND", "mmap");
  EXPECT_EQ(options::tms_cpu_backup_backend(), "mmap");
  EXPECT_EQ(options::tms_disk_backup_dir(), "/tmp");
}

TEST(Options, HostDevicesWholeNumberInRange) {
  {
    ScopedEnv env("TORPOR_HOST_DEVICES", "64");
    EXPECT_EQ(host_driver_options_from_env().devices, 64);
  }
  for (const char* bad : {"2abc", "0", "65", "-1", " 2", "2.0", "99999999999999999999999"}) {
    ScopedEnv env("TORPOR_HOST_DEVICES", bad);
    const std::string what = refusal([] { host_driver_options_from_env(); });
    EXPECT_TRUE(contains(what, std::string("TORPOR_HOST_DEVICES='") + bad + "'")) << what;
    EXPECT_TRUE(contains(what, "[1, 64]")) << what;
  }
}

TEST(Options, HostDeviceMemoryPositiveAndNoOverflow) {
  {
    ScopedEnv env("TORPOR_HOST_DEVICE_MEMORY", "512M");
    EXPECT_EQ(host_driver_options_from_env().device_bytes, std::size_t{512} << 20);
  }
  {
    ScopedEnv env("TORPOR_HOST_DEVICE_MEMORY", "1024T");
    EXPECT_EQ(host_driver_options_from_env().device_bytes, std::size_t{1} << 50);
  }
  // 2^64 + 1 in digits, and sizes whose suffix shifts them past 64 bits.
  for (const char* bad : {"0", "0G", "1025T", "18446744073709551617", "16777216T", "99999999999999999G", "12Q", "G"}) {
    ScopedEnv env("TORPOR_HOST_DEVICE_MEMORY", bad);
    const std::string what = refusal([] { host_driver_options_from_env(); });
    EXPECT_TRUE(contains(what, std::string("TORPOR_HOST_DEVICE_MEMORY='") + bad + "'")) << what;
    EXPECT_TRUE(contains(what, "[1, 1024T]")) << what;
  }
}

TEST(Options, ParseSizeRefusesWhatDoesNotFitIn64Bits) {
  EXPECT_EQ(parse_size("16777215T"), std::size_t{16777215} << 40);
  EXPECT_EQ(parse_size("18446744073709551615"), ~std::size_t{0});
  for (const char* bad : {"16777216T", "18446744073709551616", "17179869184G"}) {
    const std::string what = refusal([&] { parse_size(bad); });
    EXPECT_TRUE(contains(what, "does not fit in 64 bits")) << what;
  }
}

TEST(Options, GroupTimeoutBoundedAtADay) {
  {
    ScopedEnv env("TORPOR_GROUP_TIMEOUT_MS", "86400000");
    EXPECT_EQ(default_group_timeout(), 24h);
  }
  for (const char* bad : {"86400001", "9223372036854775807", "0", "-5", "10s", "soon"}) {
    ScopedEnv env("TORPOR_GROUP_TIMEOUT_MS", bad);
    const std::string what = refusal([] { default_group_timeout(); });
    EXPECT_TRUE(contains(what, std::string("TORPOR_GROUP_TIMEOUT_MS='") + bad + "'")) << what;
    EXPECT_TRUE(contains(what, "[1, 86400000]")) << what;
  }
}

TEST(Options, UnixGroupFromEnvironmentNamesTheVariable) {
  // A well-formed rendezvous, so that the rank and the size are what is refused.
  const std::string rendezvous = "/nonexistent#" + std::string(64, 'a');
  ScopedEnv rv("TORPOR_GROUP_RENDEZVOUS", rendezvous.c_str());
  ScopedEnv size("TORPOR_WORLD_SIZE", "2");
  {
    ScopedEnv rank("TORPOR_RANK", nullptr);
    const std::string what = refusal([] { unix_group_from_env(); });
    EXPECT_TRUE(contains(what, "TORPOR_RANK is not set")) << what;
  }
  ScopedEnv rank("TORPOR_RANK", "1x");
  EXPECT_EQ(refusal([] { unix_group_from_env(); }),
            "TORPOR_RANK='1x' is not a whole number; use a whole number in [0, 65535]");
  ScopedEnv big("TORPOR_WORLD_SIZE", "65537");
  const std::string what = refusal([] { options::world_size(); });
  EXPECT_TRUE(contains(what, "TORPOR_WORLD_SIZE='65537' is out of range; use a whole number in [1, 65536]")) << what;
}

TEST(Options, KillSwitchValuesAndFreshReads) {
  const options::Option& torpor_switch = options::option(options::id::disable_multicast);
  const options::Option& nccl_switch = options::option(options::id::nccl_nvls_enable);
  for (const char* unset : {"0", "false", "No", "OFF", ""})
    EXPECT_FALSE(options::switch_set(torpor_switch, unset)) << unset;
  for (const char* set : {"1", "true", "yes", "anything"}) EXPECT_TRUE(options::switch_set(torpor_switch, set)) << set;
  EXPECT_FALSE(options::switch_set(torpor_switch, std::nullopt));
  for (const char* off : {"0", "false", "no", "Off"}) EXPECT_TRUE(options::switch_set(nccl_switch, off)) << off;
  for (const char* on : {"1", "2", ""}) EXPECT_FALSE(options::switch_set(nccl_switch, on)) << on;

  ScopedEnv a("TORPOR_DISABLE_MULTICAST", nullptr), b("TORCH_SYMM_MEM_DISABLE_MULTICAST", nullptr),
      c("NVSHMEM_DISABLE_NVLS", nullptr), d("NCCL_NVLS_ENABLE", nullptr);
  EXPECT_EQ(options::multicast_kill_switch(), std::nullopt);
  ::setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  EXPECT_EQ(options::multicast_kill_switch(), "NVSHMEM_DISABLE_NVLS=1");
  ::setenv("TORPOR_DISABLE_MULTICAST", "yes", 1);  // earlier in the table: named first
  EXPECT_EQ(options::multicast_kill_switch(), "TORPOR_DISABLE_MULTICAST=yes");
  ::unsetenv("TORPOR_DISABLE_MULTICAST");
  ::unsetenv("NVSHMEM_DISABLE_NVLS");
  EXPECT_EQ(options::multicast_kill_switch(), std::nullopt);
}

TEST(Options, EffectiveSettingsSayValueAndSource) {
  ScopedEnv a("TORPOR_LOG", "INFO"), b("TORPOR_HOST_DEVICES", "2abc"), c("TORPOR_GROUP_TIMEOUT_MS", nullptr),
      d("TORPOR_RANK", nullptr);
  auto settings = options::effective();
  ASSERT_EQ(settings.size(), options::table().size());
  auto find = [&](std::string_view name) {
    for (const auto& s : settings)
      if (s.name == name) return s;
    ADD_FAILURE() << name << " missing";
    return options::Setting{};
  };
  auto log_setting = find("TORPOR_LOG");
  EXPECT_EQ(log_setting.value, "info");
  EXPECT_TRUE(log_setting.from_environment);
  EXPECT_EQ(log_setting.error, "");
  auto devices = find("TORPOR_HOST_DEVICES");
  EXPECT_EQ(devices.value, "2abc");
  EXPECT_TRUE(devices.from_environment);
  EXPECT_TRUE(contains(devices.error, "[1, 64]")) << devices.error;
  auto timeout = find("TORPOR_GROUP_TIMEOUT_MS");
  EXPECT_EQ(timeout.value, "60000");
  EXPECT_FALSE(timeout.from_environment);
  auto rank = find("TORPOR_RANK");
  EXPECT_EQ(rank.value, "");
  EXPECT_FALSE(rank.from_environment);
}

TEST(Options, EveryDefaultIsValid) {
  for (const options::Option& o : options::table()) {
    if (o.default_text.empty()) continue;
    EXPECT_NO_THROW(options::validate(o, o.default_text)) << o.name;
  }
}

// The configuration reference's table of environment variables (docs/reference/configuration.md,
// once README's Configuration section, hence the test's name) lists exactly the table's
// variables, in its order, with its defaults ("unset" for none).
TEST(Options, ReadmeConfigurationTableMatches) {
  std::ifstream in(TORPOR_SOURCE_DIR "/docs/reference/configuration.md");
  ASSERT_TRUE(in) << "cannot read " TORPOR_SOURCE_DIR "/docs/reference/configuration.md";
  std::string line;
  bool inside = false;
  std::vector<std::pair<std::string, std::string>> rows;
  const std::regex row(R"(^\| `([A-Z_]+)` \| ([^|]*?) \|)");
  while (std::getline(in, line)) {
    if (line.rfind("## ", 0) == 0) inside = line == "## Environment variables";
    std::smatch m;
    if (inside && std::regex_search(line, m, row)) {
      std::string def = m[2].str();
      if (def == "unset")
        def.clear();
      else if (def.size() >= 2 && def.front() == '`' && def.back() == '`')
        def = def.substr(1, def.size() - 2);
      rows.emplace_back(m[1].str(), def);
    }
  }
  std::vector<std::pair<std::string, std::string>> expected;
  for (const options::Option& o : options::table())
    expected.emplace_back(std::string(o.name), std::string(o.default_text));
  EXPECT_EQ(rows, expected);
}

}  // namespace
}  // namespace torpor
