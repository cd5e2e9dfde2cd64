#!/usr/bin/env bash
# Makes sure what torpor needs is here, and installs only what is missing.
#
# Every tool is checked by running it, whatever installed it (apt, pip, a module system): a C++
# compiler, CMake at least the minimum in CMakeLists.txt, Ninja, python3 with pytest; then the
# headers of the libraries (fmt, CLI11, nlohmann-json, GoogleTest/GoogleMock, Google Benchmark).
# What is missing is installed with apt from Debian (or Ubuntu) where apt exists; the lint and
# format tools scripts/lint.sh runs (clang-format 14, clang-tidy, flake8, black) are installed
# the same way when apt can (clang-tidy 22 where the distribution has it, else 14: .clang-tidy says
# why), and otherwise only reported: lint skips a missing tool. So are ccache
# (scripts/test.sh compiles through it when present), doxygen (scripts/test.sh's API reference
# stage; skipped without it) and clang
# with libFuzzer (scripts/test.sh's fuzz run; without it the fuzz targets run their seeded random
# driver only). On a machine
# where everything needed runs (the GPU machines: cmake, ninja and pytest from pip, no network)
# the script installs nothing and succeeds. The CUDA toolkit (nvcc, cuda.h) is expected where
# NVIDIA installs it (/usr/local/cuda); without it torpor builds the host backend alone.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "install-deps: $*"; }

# The minimum CMake version, from `cmake_minimum_required(VERSION A.B...)` in CMakeLists.txt.
cmake_min=$(sed -n 's/^cmake_minimum_required(VERSION \([0-9][0-9.]*\).*/\1/p' CMakeLists.txt | head -n 1)
cmake_min=${cmake_min%%...*}  # the lower end of a VERSION min...max range
[ -n "$cmake_min" ] || { say "cannot read cmake_minimum_required from CMakeLists.txt"; exit 1; }

version_at_least() {  # have want: true when version `have` >= `want`
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]
}

cmake_ok() {
  command -v cmake > /dev/null || return 1
  local have
  have=$(cmake --version 2> /dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p' | head -n 1)
  [ -n "$have" ] && version_at_least "$have" "$cmake_min"
}
cxx_ok() { "${CXX:-c++}" --version > /dev/null 2>&1 || g++ --version > /dev/null 2>&1; }
ninja_ok() { ninja --version > /dev/null 2>&1; }
python_ok() { python3 -c 'import sys; sys.exit(0)' > /dev/null 2>&1; }
# tests/python picks /usr/bin/python3 or python3 on PATH, whichever imports pytest.
pytest_ok() {
  local p
  for p in /usr/bin/python3 "$(command -v python3 || true)"; do
    [ -n "$p" ] && [ -x "$p" ] && "$p" -c 'import pytest' > /dev/null 2>&1 && return 0
  done
  return 1
}
# A header a library's package provides, searched where compilers look by default.
header_ok() {
  local h=$1 d
  for d in /usr/include /usr/local/include; do [ -f "$d/$h" ] && return 0; done
  return 1
}

missing=()       # apt packages for what is required
lint_missing=()  # apt packages for lint tools (optional)
cxx_ok || missing+=(g++)
cmake_ok || missing+=(cmake)
ninja_ok || missing+=(ninja-build)
python_ok || missing+=(python3)
pytest_ok || missing+=(python3-pytest)
header_ok fmt/format.h || missing+=(libfmt-dev)
header_ok CLI/CLI.hpp || missing+=(libcli11-dev)
header_ok nlohmann/json.hpp || missing+=(nlohmann-json3-dev)
header_ok gtest/gtest.h || missing+=(libgtest-dev)
header_ok gmock/gmock.h || missing+=(libgmock-dev)
header_ok benchmark/benchmark.h || missing+=(libbenchmark-dev)
clang-format-14 --version > /dev/null 2>&1 || lint_missing+=(clang-format-14)
# The clang-tidy package to install, or nothing: 22 where apt has it (Debian 12's security
# updates), since it lints the tree in a fraction of 14's time (.clang-tidy says why); else 14,
# which the tree passes too. Asked after the required packages are installed: that install
# refreshes apt's lists when they are missing, and only then may 22 be a candidate.
tidy_package() {
  clang-tidy-22 --version > /dev/null 2>&1 && return 0
  if apt-cache policy clang-tidy-22 2> /dev/null | grep 'Candidate: [0-9]' > /dev/null; then  # not -q: pipefail
    echo clang-tidy-22
  elif ! clang-tidy-14 --version > /dev/null 2>&1; then
    echo clang-tidy-14
  fi
}
flake8 --version > /dev/null 2>&1 || lint_missing+=(flake8)
black --version > /dev/null 2>&1 || lint_missing+=(black)
# ccache: scripts/test.sh compiles through it when it runs (the wheel's build then finds the
# release build's objects); optional like the lint tools.
ccache --version > /dev/null 2>&1 || lint_missing+=(ccache)
# doxygen: scripts/test.sh's API reference stage (docs/api/Doxyfile) when present; optional too.
doxygen --version > /dev/null 2>&1 || lint_missing+=(doxygen)
# libFuzzer ships in the runtime package of clang's own major version (14 on Debian 12, 18 on
# Ubuntu 24.04): checked by linking an empty fuzz target.
fuzzer_ok() {
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer - -o /dev/null > /dev/null 2>&1
}
clang_rt_package() {
  echo "libclang-rt-$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n 1)-dev"
}
if ! clang++ --version > /dev/null 2>&1; then
  lint_missing+=(clang)
elif ! fuzzer_ok; then
  lint_missing+=("$(clang_rt_package)")
fi

if [ ${#missing[@]} -eq 0 ] && [ ${#lint_missing[@]} -eq 0 ] && [ -z "$(tidy_package)" ]; then
  say "every tool runs (cmake >= $cmake_min, ninja, pytest, the compiler, lint tools, ccache, doxygen); nothing to install"
  exit 0
fi

sudo=""
[ "$(id -u)" -ne 0 ] && command -v sudo > /dev/null && sudo="sudo"
apt_install() {  # package...: true when apt installed them all
  command -v apt-get > /dev/null || return 1
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y --no-install-recommends "$@" ||
    { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends "$@"; }
}

if [ ${#missing[@]} -gt 0 ]; then
  say "missing: ${missing[*]}"
  if ! apt_install "${missing[@]}"; then
    say "could not install ${missing[*]} (no apt, or apt failed): install them, then run this again"
    exit 1
  fi
  # Installed: they must run now (a cmake older than $cmake_min from apt is not enough).
  cmake_ok || { say "cmake $(cmake --version 2> /dev/null | head -n 1) is older than $cmake_min"; exit 1; }
fi
tidy=$(tidy_package)
[ -z "$tidy" ] || lint_missing+=("$tidy")
if [ ${#lint_missing[@]} -gt 0 ]; then
  if apt_install "${lint_missing[@]}"; then
    # clang came just now: its libFuzzer runtime is a package of its own version.
    if clang++ --version > /dev/null 2>&1 && ! fuzzer_ok; then
      apt_install "$(clang_rt_package)" || say "libFuzzer not installed: fuzz targets run their random driver only"
    fi
  else
    say "lint, fuzz, cache or documentation tools not installed (${lint_missing[*]}): scripts/lint.sh skips" \
      "them, the fuzz targets run their random driver only, saying so, the builds compile without ccache" \
      "and the API reference stage is skipped"
  fi
fi
exit 0
