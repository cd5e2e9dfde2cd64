// The torpor CLI's commands: each one's options and its run function, which returns the exit
// code. command_line.cpp turns the command line into these options (flags, their checks and
// defaults, --help) and is the one file that includes CLI11: its headers cost more to compile and
// to lint than most of the files that would otherwise include them.
#pragma once

#include <cstddef>
#include <string>

namespace torpor::cli {

struct ProbeOptions {
  std::string backend = "auto";
  bool json = false;
  bool config = false;  // the options table's effective settings instead of probing
};
int run_probe(const ProbeOptions& options);

struct DoctorOptions {
  std::string backend = "auto";
  bool json = false;
  std::size_t host_store = 0;  // bytes the store will page-lock; 0 = the machine's host memory
};
int run_doctor(const DoctorOptions& options);

struct SymmetricCheckOptions;  // symmetric_check.hpp
int run_symmetric_check(const SymmetricCheckOptions& options);

struct StressOptions;  // stress_plan.hpp
int run_stress(const StressOptions& options);

struct RlOptions;  // rl_loop.hpp
int run_rl_loop(const RlOptions& options);

// Parses argv and runs the command it names; the exit code (a usage error's is CLI11's).
int run_command_line(int argc, char** argv);

}  // namespace torpor::cli
