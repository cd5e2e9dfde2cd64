#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls the README's test command, which runs
# this; docs/development.md describes it). Three builds:
#   build/        release build (Release, the main command's build type), CUDA backend compiled when nvcc is present; every test
#                 (cuda-typed tests skip, saying why, when no GPU is present), then an
#                 install and a project outside the tree built against it with find_package,
#                 then scripts/check_wheel.sh (pip install . in a fresh venv, the package
#                 and a C++ consumer from it), then scripts/lint.sh (format and lint;
#                 clang-tidy uses this build's compile_commands.json), then the API reference
#                 (doxygen docs/api/Doxyfile, failing on a warning; skipped without doxygen)
#   build-asan/   host backend under AddressSanitizer + UndefinedBehaviorSanitizer (clang where
#                 it can link them, else the default compiler; build-tsan/ likewise); every test
#                 executable's tests (the torpor CLI's runs, cli.*, are the first build's), each
#                 gtest suite in one process (-DTORPOR_TESTS_BY_SUITE=ON: under the sanitizers
#                 starting a test process costs more than most tests), the fuzz targets of
#                 tests/fuzz among them: with clang's libFuzzer, libtorpor is
#                 compiled for its coverage and each target replays its corpus and fuzzes for
#                 TORPOR_FUZZ_SECONDS (default 20 s each), else they run the seeded random driver
#   build-tsan/   host backend under ThreadSanitizer; the threaded tests, from the test files that
#                 hold them (-DTORPOR_THREADED_TESTS_ONLY=ON)
# Set TORPOR_SKIP_SANITIZERS=1 to run the first build only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
jobs=$(nproc)
# Each stage's wall time, printed as it ends and again at the end: CI's time budget is spent here.
timings=()
stage_started=$SECONDS
stage_done() {
  timings+=("$1: $((SECONDS - stage_started)) s")
  echo "torpor: stage $1 took $((SECONDS - stage_started)) s"
  stage_started=$SECONDS
}

# ccache, where installed, for the library targets (-DTORPOR_LIBRARY_LAUNCHER): the wheel's build
# (check_wheel.sh, build-wheel/) compiles them with the release build's compile lines, so with the
# base directory at the repository it finds the release build's objects instead of compiling them
# again. Without ccache the same builds run, only slower.
launcher=()
if ccache --version > /dev/null 2>&1; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  launcher=(-DTORPOR_LIBRARY_LAUNCHER=ccache)
else
  launcher=(-DTORPOR_LIBRARY_LAUNCHER=)  # a launcher an earlier configure set is gone too
  echo "torpor: ccache not installed (scripts/install-deps.sh installs it): the wheel's build compiles the library again"
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "${launcher[@]}"
cmake --build build -j "$jobs"
stage_done "release build"
ctest --test-dir build -j "$jobs" --output-on-failure
stage_done "release tests"
# The installed package works for a project outside the tree (find_package(torpor)).
cmake --install build --prefix build/_install > /dev/null
cmake -S tests/consumer -B build/_consumer -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/_install" > /dev/null
cmake --build build/_consumer > /dev/null
LD_LIBRARY_PATH="$PWD/build/_install/lib:${LD_LIBRARY_PATH:-}" build/_consumer/consumer
stage_done "install and consumer"
# `pip install .` in a fresh venv builds libtorpor (build-wheel/, ccache) and bundles it, with its
# CMake package: the package imports outside the checkout and a consumer builds from the wheel.
CMAKE_ARGS="${CMAKE_ARGS:-} ${launcher[*]}" scripts/check_wheel.sh
stage_done "wheel"
scripts/lint.sh
stage_done lint
# The API reference (docs/api/Doxyfile: the public headers and the Python docstrings, into
# build/api/html); any Doxygen warning fails the stage. Optional like the lint tools.
if command -v doxygen > /dev/null; then
  rm -rf build/api
  doxygen docs/api/Doxyfile
  stage_done "api reference"
else
  echo "torpor: doxygen not installed (scripts/install-deps.sh installs it): the API reference stage skipped"
fi

# The sanitizer builds compile with clang where clang can link that sanitizer: it compiles these
# unoptimised, instrumented builds in about half of g++'s time (the stage times in bench/results). Where
# it cannot (no clang: the GPU image), the default compiler builds them.
sanitizer_compiler() {  # sanitizer flag -> "CC=clang CXX=clang++" or nothing
  echo 'int main() { return 0; }' | clang++ -x c++ -fsanitize="$1" - -o /dev/null > /dev/null 2>&1 &&
    echo "CC=clang CXX=clang++"
}
# Whether clang links libFuzzer with ASan + UBSan: then the ASan build fuzzes coverage-guided (its
# library compiled for libFuzzer's coverage) instead of a separate fuzz build compiling it again.
libfuzzer_ok() {
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o /dev/null > /dev/null 2>&1
}

if [ "${TORPOR_SKIP_SANITIZERS:-0}" != 1 ]; then
  fuzz=(-DTORPOR_FUZZ_COVERAGE=OFF -DTORPOR_FUZZ_SECONDS=5)
  if command -v clang++ > /dev/null && libfuzzer_ok; then
    fuzz=(-DTORPOR_FUZZ_COVERAGE=ON -DTORPOR_FUZZ_SECONDS="${TORPOR_FUZZ_SECONDS:-20}")
  else
    echo "torpor: clang with libFuzzer not installed (scripts/install-deps.sh): the fuzz targets run their seeded" \
      "random driver only"
  fi
  # shellcheck disable=SC2046  # the words are the assignments, or none
  env $(sanitizer_compiler address,undefined) cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORPOR_CUDA=OFF -DTORPOR_BUILD_BENCH=OFF \
        -DTORPOR_SANITIZE=address,undefined -DTORPOR_TESTS_BY_SUITE=ON "${fuzz[@]}"
  # The test executables, not the torpor CLI: its end-to-end runs (cli.*, the soak among them)
  # are the first build's. Under ASan they and the CLI's compile are the slowest part of the
  # stage, and the library code they drive is the unit tests' (tools' bookkeeping:
  # torpor_tools_tests).
  cmake --build build-asan -j "$jobs" --target torpor_tests torpor_fusion_tests torpor_tools_tests \
        torpor_fuzz_c_api torpor_fuzz_hub_protocol
  stage_done "asan build"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -j "$jobs" --output-on-failure -E '^(cli|version)\.'
  stage_done "asan tests"

  # shellcheck disable=SC2046
  env $(sanitizer_compiler thread) cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORPOR_CUDA=OFF -DTORPOR_BUILD_BENCH=OFF \
        -DTORPOR_BUILD_TOOLS=OFF -DTORPOR_SANITIZE=thread -DTORPOR_THREADED_TESTS_ONLY=ON
  cmake --build build-tsan -j "$jobs" --target torpor_tests torpor_fusion_tests  # where the Threads tests live
  stage_done "tsan build"
  TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build-tsan -j "$jobs" --output-on-failure -R 'Threads'
  stage_done "tsan tests"
fi
printf 'torpor: stage times: %s\n' "${timings[@]}"
echo "torpor: all tests passed"
