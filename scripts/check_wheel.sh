#!/usr/bin/env bash
# The Python package as a user installs it (issue 28): `pip install .` at the repository root in a
# fresh venv, offline (Debian's pip, setuptools and wheel; --no-build-isolation --no-deps), builds
# libtorpor with CMake and puts it, its headers and its CMake package inside the package. Then,
# with no TORPOR_LIBRARY and outside the checkout:
#   - `import torpor; torpor.Pool()` works on the host backend and loads the bundled library;
#   - the bundled library needs only system libraries (readelf -d: no libfmt, nothing of CUDA);
#   - `python -m torpor --cmake-dir` names the CMake package, and tests/consumer (torpor::fusion,
#     torpor::kernels, torpor::torpor) configures, builds and runs against it;
#   - `pip wheel` makes a wheel tagged for this platform (py3-none-linux_<machine>);
#   - with the machine's PyTorch and a GPU (the GPU image), that wheel, installed for the Python
#     that has torch, keeps a tensor made in torpor.use_pool at its address with its bytes through
#     a level-1 sleep.
# scripts/test.sh runs it after the release build; the CMake build it does lives in build-wheel/
# (setup.py) and compiles through ccache when test.sh set it up: the release build's objects.
# usage: scripts/check_wheel.sh [WORK_DIR]   (default: a fresh temporary directory, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${TORPOR_WHEEL_PYTHON:-/usr/bin/python3}
work=${1:-$(mktemp -d)}
[ $# -ge 1 ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"
say() { echo "check_wheel: $*"; }
fail() { echo "check_wheel: FAIL: $*" >&2; exit 1; }

for module in pip setuptools wheel venv; do
  "$python" -c "import $module" 2>/dev/null || fail "$python lacks $module (Debian: python3-pip python3-setuptools python3-wheel python3-venv)"
done
rm -rf "$work/venv"
"$python" -m venv --system-site-packages "$work/venv"
venv_python=$work/venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# Not the checkout's: the package must find its own library, and import from site-packages.
unset TORPOR_LIBRARY PYTHONPATH
started=$SECONDS
"$venv_python" -m pip install --no-build-isolation --no-deps --quiet "$repo" > "$work/pip-install.log" 2>&1 ||
  { tail -40 "$work/pip-install.log"; fail "pip install . failed (above)"; }
say "pip install . took $((SECONDS - started)) s"

cd "$work"
out=$(TORPOR_BACKEND=host "$venv_python" -c '
import torpor
with torpor.Pool() as p:
    a = p.alloc(4096, "weights", "state")
    p.write(a, b"kept"); p.sleep(1); p.wake_up()
    print(torpor.library_path(), p.read(a, 4).decode(), torpor.__version__, torpor.library_version())
') || fail "import torpor; torpor.Pool() failed in the venv"
read -r lib kept version lib_version <<< "$out"
case "$lib" in "$work/venv/"*) ;; *) fail "torpor loaded $lib, not the library inside the installed package" ;; esac
[ "$kept" = kept ] || fail "the bytes did not survive a sleep: $out"
want=$(head -1 "$repo/VERSION")
[ "$version" = "$want" ] && [ "$lib_version" = "$want" ] || fail "versions $version / $lib_version, VERSION says $want"
say "torpor.Pool() on the host backend with $lib ($version)"

# Only system libraries: the C and C++ runtimes and the loader; never libfmt or CUDA's.
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort)
bad=$(echo "$needed" | grep -vE '^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[-_a-z0-9]*)\.so(\.[0-9]+)*$' || true)
[ -z "$bad" ] || fail "the bundled library needs non-system libraries: $(echo $bad)"
say "needs only: $(echo $needed)"

cmake_dir=$("$venv_python" -m torpor --cmake-dir) || fail "python -m torpor --cmake-dir failed"
rm -rf "$work/consumer"
cmake -S "$repo/tests/consumer" -B "$work/consumer" -G Ninja -Dtorpor_DIR="$cmake_dir" > "$work/consumer.log" 2>&1 &&
  cmake --build "$work/consumer" >> "$work/consumer.log" 2>&1 ||
  { tail -30 "$work/consumer.log"; fail "tests/consumer did not build against $cmake_dir"; }
"$work/consumer/consumer" || fail "the consumer built against the wheel's CMake package failed"
say "tests/consumer built with -Dtorpor_DIR=$cmake_dir and ran"

rm -rf "$work/wheels"
"$venv_python" -m pip wheel --no-build-isolation --no-deps --quiet -w "$work/wheels" "$repo" > "$work/pip-wheel.log" 2>&1 ||
  { tail -40 "$work/pip-wheel.log"; fail "pip wheel . failed (above)"; }
wheel=$(ls "$work"/wheels/torpor-*.whl)
machine=$(uname -m)
case "$(basename "$wheel")" in
  "torpor-$want-py3-none-linux_$machine.whl") ;;
  *) fail "$(basename "$wheel"): expected the tag py3-none-linux_$machine" ;;
esac
# The listing first: grep -q stops reading early, and under pipefail the lister's broken pipe
# would fail the check.
listing=$("$python" -m zipfile -l "$wheel")
grep -q 'torpor/_lib/lib/libtorpor.so' <<< "$listing" || fail "$wheel lacks the library"
grep -q 'torpor/_lib/lib/cmake/torpor/torporConfig.cmake' <<< "$listing" || fail "$wheel lacks the CMake package"
# The wheel with the machine's PyTorch (the GPU image has one): installed (pip --target) for the
# first Python that imports torch, the venv's or `python3` on PATH, a tensor made in a torpor pool
# keeps its address and its bytes through a level-1 sleep, checked against values computed on the
# CPU. Without PyTorch or a GPU this says so and goes on.
torch_python=
torch_missing=
for candidate in "$venv_python" "$(command -v python3 || true)"; do
  [ -n "$candidate" ] || continue
  if why=$("$candidate" -c 'import torch' 2>&1); then torch_python=$candidate; break; fi
  torch_missing+="${torch_missing:+; }$candidate: $(tail -1 <<< "$why")"
done
if [ -z "$torch_python" ]; then
  say "PyTorch check skipped (no Python here imports torch: $torch_missing)"
else
  rm -rf "$work/torch-site"
  "$torch_python" -m pip install --no-deps --no-index --quiet --target "$work/torch-site" "$wheel" \
    > "$work/torch-install.log" 2>&1 || { tail -20 "$work/torch-install.log"; fail "pip could not install $wheel for $torch_python"; }
  torch_check=$(cd "$work" && PYTHONPATH="$work/torch-site" TORPOR_BACKEND=cuda "$torch_python" -c '
import torch
if not torch.cuda.is_available():
    print(f"skip: PyTorch {torch.__version__} sees no GPU")
    raise SystemExit(0)
import torpor
with torpor.use_pool("weights"):
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
address = w.data_ptr()
torpor.sleep(level=1)
torpor.wake_up()
same = w.data_ptr() == address and torch.equal(w.cpu(), torch.arange(1 << 20, dtype=torch.float32))
print(("ok" if same else "FAIL") + f": PyTorch {torch.__version__}, {torpor.library_path()}")
' 2> "$work/torch-check.log") || { tail -20 "$work/torch-check.log"; fail "the wheel with PyTorch failed (above)"; }
  case "$torch_check" in
    ok:*"$work/torch-site/"*) say "$torch_check ($torch_python): a tensor in torpor.use_pool kept its address and bytes through sleep(1)" ;;
    skip:*) say "PyTorch check skipped (${torch_check#skip: })" ;;
    *) tail -20 "$work/torch-check.log"; fail "the wheel with PyTorch ($torch_python): $torch_check" ;;
  esac
fi
say "PASS: $(basename "$wheel") holds the library and the CMake package ($((SECONDS - started)) s in all)"
