#!/usr/bin/env bash
# Installs what torpor needs from Debian (or Ubuntu): compiler, CMake, Ninja and the dev
# packages, and the lint and format tools scripts/lint.sh runs (clang-format and clang-tidy 14,
# the version the tree follows, packaged by Debian 12 and Ubuntu 24.04 alike; flake8; black), and
# the default clang with its runtime libraries (libFuzzer: the fuzz run of scripts/test.sh).
# The CUDA toolkit (nvcc, cuda.h) is expected where NVIDIA installs it (/usr/local/cuda);
# without it torpor builds the host backend alone.
set -euo pipefail
packages=(g++ cmake ninja-build libfmt-dev libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev
          libbenchmark-dev python3 python3-pytest python3-pip python3-setuptools python3-wheel
          clang-format-14 clang-tidy-14 flake8 black clang)
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
install_missing() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  $sudo apt-get install -y --no-install-recommends "${missing[@]}" ||
    { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends "${missing[@]}"; }
}
install_missing "${packages[@]}"
# libFuzzer ships in the runtime package of clang's own major version (14 on Debian 12, 18 on
# Ubuntu 24.04).
clang_major=$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n1)
install_missing "libclang-rt-${clang_major}-dev"
