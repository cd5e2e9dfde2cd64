#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls the README's test command, which runs
# this). Three builds:
#   build/        release build, CUDA backend compiled when nvcc is present; every test
#                 (cuda-typed tests skip, saying why, when no GPU is present), then an
#                 install and a project outside the tree built against it with find_package,
#                 then scripts/lint.sh (format and lint; clang-tidy uses this build's
#                 compile_commands.json)
#   build-asan/   host backend under AddressSanitizer + UndefinedBehaviorSanitizer; every test
#   build-tsan/   host backend under ThreadSanitizer; the threaded tests
# Set TORPOR_SKIP_SANITIZERS=1 to run the first build only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
jobs=$(nproc)

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
cmake --build build -j "$jobs"
ctest --test-dir build -j "$jobs" --output-on-failure
# The installed package works for a project outside the tree (find_package(torpor)).
cmake --install build --prefix build/_install > /dev/null
cmake -S tests/consumer -B build/_consumer -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build/_install" > /dev/null
cmake --build build/_consumer > /dev/null
LD_LIBRARY_PATH="$PWD/build/_install/lib:${LD_LIBRARY_PATH:-}" build/_consumer/consumer
scripts/lint.sh

if [ "${TORPOR_SKIP_SANITIZERS:-0}" != 1 ]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORPOR_CUDA=OFF -DTORPOR_BUILD_BENCH=OFF \
        -DTORPOR_SANITIZE=address,undefined
  cmake --build build-asan -j "$jobs"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan -j "$jobs" --output-on-failure

  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTORPOR_CUDA=OFF -DTORPOR_BUILD_BENCH=OFF \
        -DTORPOR_BUILD_TOOLS=OFF -DTORPOR_SANITIZE=thread
  cmake --build build-tsan -j "$jobs"
  TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build-tsan -j "$jobs" --output-on-failure -R 'Threads'
fi
echo "torpor: all tests passed"
