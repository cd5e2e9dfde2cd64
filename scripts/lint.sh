#!/usr/bin/env bash
# Lint and format checks, as CI runs them (scripts/test.sh calls this after its first build):
#   clang-format  every tracked C++ and CUDA file against .clang-format (--dry-run --Werror)
#   clang-tidy    .clang-tidy's checks on the C++ sources of allocator/, fusion/ and tools/ that
#                 the build compiles, with its compile_commands.json (build/, or
#                 TORPOR_LINT_BUILD=DIR; scripts/test.sh's first configure exports it); a file
#                 whose inputs are unchanged since it passed is not analysed again (the cache
#                 below, TORPOR_TIDY_CACHE)
#   flake8        Python lint (.flake8) on every tracked .py file
#   black         Python format (pyproject.toml's [tool.black]) of the same files, --check
# `scripts/lint.sh --fix` applies clang-format and black instead of checking (no linters then).
#
# A tool that is missing is skipped, saying so, and does not fail the run (the GPU machines have
# none; scripts/install-deps.sh installs them all on Debian 12 and Ubuntu 24.04). So is a
# formatter of another major version than the tree follows (clang-format 14, black 23: other
# versions format differently). A check that runs and finds something fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."

fix=0
case "${1:-}" in
  --fix) fix=1 ;;
  "") ;;
  *) echo "usage: scripts/lint.sh [--fix]" >&2; exit 2 ;;
esac
jobs=$(nproc)
build=${TORPOR_LINT_BUILD:-build}
failed=()
skipped=()
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

say() { echo "lint: $*"; }
skip() {  # part, reason...
  local part=$1
  shift
  skipped+=("$part")
  say "skipped $part: $*"
}
# The first of the named commands that is installed.
first_tool() {
  local t
  for t in "$@"; do command -v "$t" >/dev/null 2>&1 && { echo "$t"; return; }; done
}
major_version() { "$1" --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+' | head -1 | cut -d. -f1; }
# Formatters must be the version the tree follows.
formatter() {  # name, wanted major version, candidates...
  local name=$1 want=$2 tool version
  shift 2
  tool=$(first_tool "$@")
  if [ -z "$tool" ]; then
    skip "$name" "not installed (scripts/install-deps.sh installs it)"
    return 1
  fi
  version=$(major_version "$tool")
  if [ "$version" != "$want" ]; then
    skip "$name" "$tool is version $version; the tree follows version $want, and other versions format differently"
    return 1
  fi
  echo "$tool" > "$tmp/$name.tool"
}

mapfile -d '' cxx_files < <(git ls-files -z '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh')
mapfile -d '' py_files < <(git ls-files -z '*.py')

# --- C++ and CUDA format ---------------------------------------------------------------------
start=$SECONDS
if formatter clang-format 14 clang-format-14 clang-format; then
  cf=$(cat "$tmp/clang-format.tool")
  if [ "$fix" = 1 ]; then
    printf '%s\0' "${cxx_files[@]}" | xargs -0 -P "$jobs" -n 16 "$cf" -i --style=file
    say "clang-format applied to ${#cxx_files[@]} files"
  else
    printf '%s\0' "${cxx_files[@]}" |
      xargs -0 -P "$jobs" -n 16 "$cf" --dry-run --Werror --ferror-limit=1 --style=file > "$tmp/format.log" 2>&1
    bad=$(grep -c ': error: code should be clang-formatted' "$tmp/format.log")
    if [ "$bad" -gt 0 ]; then
      grep -A2 ': error: ' "$tmp/format.log" | head -40
      say "clang-format: $bad of ${#cxx_files[@]} files differ from .clang-format (the first difference of each" \
          "is above, up to 10); scripts/lint.sh --fix formats them"
      failed+=(clang-format)
    elif [ -s "$tmp/format.log" ]; then
      cat "$tmp/format.log"
      failed+=(clang-format)
    else
      say "clang-format: ${#cxx_files[@]} files ok ($((SECONDS - start)) s)"
    fi
  fi
fi

# --- C++ lint ----------------------------------------------------------------------------------
start=$SECONDS
# 22 first: it skips matching inside system headers, most of 14's time on this tree (.clang-tidy).
ct=$(first_tool clang-tidy-22 clang-tidy-14 clang-tidy)
if [ "$fix" = 1 ]; then
  :
elif [ -z "$ct" ]; then
  skip clang-tidy "not installed (scripts/install-deps.sh installs it)"
elif [ ! -f "$build/compile_commands.json" ]; then
  skip clang-tidy "no $build/compile_commands.json (configure with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON, as" \
    "scripts/test.sh does, or set TORPOR_LINT_BUILD)"
else
  case "$(major_version "$ct")" in
    22 | 14) ;;
    *) say "clang-tidy: $ct is neither version 22 nor 14, which the tree is checked with; it may report" \
      "findings that those lack" ;;
  esac
  # The sources this build compiles (a build without CUDA has no cuda_*.cpp of fusion/), each with
  # its cache key: a file whose key passed before is not analysed again (TORPOR_TIDY_CACHE, default
  # $XDG_CACHE_HOME/torpor/tidy, i.e. ~/.cache/torpor/tidy; $build/tidy-cache/ without a home). The
  # key hashes everything the result depends on: clang-tidy's and the compiler's versions,
  # .clang-tidy, the file's compile command and the content of every file its compile read (the
  # file itself and every header, NOLINT comments included), so an edit anywhere it reaches analyses
  # it again. The list of files read is the build's own (ninja's dependency log, free to read); where
  # the build has none for a file (another generator, a stale entry) the file is preprocessed
  # instead and its text hashed. The checkout's own path is taken out of the command and the paths
  # first: another clone of the same tree (CI's) finds the keys this one left. Findings are never
  # cached.
  user_cache=${XDG_CACHE_HOME:-${HOME:+$HOME/.cache}}
  cache=${TORPOR_TIDY_CACHE:-${user_cache:+$user_cache/torpor/tidy}}
  cache=${cache:-$build/tidy-cache}
  mkdir -p "$cache"
  python3 - "$build/compile_commands.json" "$ct" "$cache" "$jobs" > "$tmp/tidy.files" <<'EOF'
import concurrent.futures, hashlib, json, os, shlex, subprocess, sys
db, tidy, cache, jobs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
root = os.getcwd()  # the checkout; out of every key, so that keys do not depend on where it is
entries = {os.path.realpath(e["file"]): e for e in json.load(open(db))}
tracked = subprocess.run(["git", "ls-files", "allocator/*.cpp", "fusion/*.cpp", "tools/*.cpp"],
                         capture_output=True, text=True, check=True).stdout.split()
common = hashlib.sha256()
common.update(subprocess.run([tidy, "--version"], capture_output=True).stdout)
common.update(open(".clang-tidy", "rb").read())


def ninja_deps(build_dir):
    """{object path: [files its compile read]} from ninja's dependency log; {} without one."""
    r = subprocess.run(["ninja", "-C", build_dir, "-t", "deps"], capture_output=True, text=True)
    deps, current = {}, None
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        if not line.startswith(" ") and ": #deps" in line:
            obj, _, state = line.partition(": #deps")
            current = deps.setdefault(obj, []) if state.rstrip().endswith("(VALID)") else None
        elif line.strip() and current is not None:
            current.append(line.strip())
    return deps


deps_of = ninja_deps(os.path.dirname(db) or ".")
content_hashes = {}


def content_hash(path):
    if path not in content_hashes:
        try:
            content_hashes[path] = hashlib.sha256(open(path, "rb").read()).hexdigest()
        except OSError:
            content_hashes[path] = "missing"
    return content_hashes[path]


def key(f):
    e = entries[os.path.realpath(f)]
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    pre, skip, obj = [], False, None
    for i, a in enumerate(args):
        if skip:
            skip = False
        elif a == "-o" or a in ("-MF", "-MT", "-MQ"):
            skip = True
            if a == "-o" and i + 1 < len(args):
                obj = args[i + 1]
        elif a not in ("-c", "-MD", "-MMD"):
            pre.append(a)
    h = common.copy()
    h.update(subprocess.run([args[0], "--version"], capture_output=True).stdout)
    h.update(" ".join(args).replace(root, "<checkout>").encode())
    read = deps_of.get(obj) if obj else None
    if read:
        for path in read:
            full = os.path.join(e["directory"], path)
            h.update(f"{path.replace(root, '<checkout>')} {content_hash(full)}\n".encode())
        return f, h.hexdigest()
    r = subprocess.run(pre + ["-E", "-C", "-o", "-"], cwd=e["directory"], capture_output=True)
    if r.returncode != 0:
        return f, ""  # analysed (and its error shown) by clang-tidy
    h.update(r.stdout.replace(root.encode(), b"<checkout>"))
    return f, h.hexdigest()


built = [f for f in tracked if os.path.realpath(f) in entries]
with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    keyed = dict(pool.map(key, built))
for f in tracked:
    if f not in keyed:
        print("-" + f)
    elif keyed[f] and os.path.exists(os.path.join(cache, keyed[f])):
        print("=" + f)
    else:
        print(f"{f} {keyed[f] or 'none'}")
EOF
  mapfile -t tidy_jobs < <(grep -v '^[-=]' "$tmp/tidy.files")
  not_built=$(grep -c '^-' "$tmp/tidy.files")
  cached=$(grep -c '^=' "$tmp/tidy.files")
  tidy_files=()
  for j in "${tidy_jobs[@]}"; do tidy_files+=("${j%% *}"); done
  mkdir -p "$tmp/tidy"
  # One clang-tidy per file, $jobs at a time; a file's output is kept when it has findings, and
  # its key goes into the cache when it has none.
  printf '%s\n' "${tidy_jobs[@]}" | xargs -r -P "$jobs" -L1 sh -c \
    'log="$3/$(echo "$4" | tr / _)"; if "$0" -p "$1" --quiet --warnings-as-errors="*" "$4" > "$log" 2>&1; then
       [ "$5" = none ] || touch "$2/$5"; else touch "$log.failed"; fi' \
    "$ct" "$build" "$cache" "$tmp/tidy"
  mapfile -t tidy_failed < <(find "$tmp/tidy" -name '*.failed' | sort)
  if [ ${#tidy_failed[@]} -gt 0 ]; then
    for f in "${tidy_failed[@]}"; do grep -v ' warnings\? generated\.$' "${f%.failed}"; done
    say "clang-tidy: findings in ${#tidy_failed[@]} of ${#tidy_files[@]} files (above); fix them, or silence one" \
        "on its line with NOLINT(check): reason"
    failed+=(clang-tidy)
  else
    say "clang-tidy: $((${#tidy_files[@]} + cached)) files ok ($((SECONDS - start)) s; $cached unchanged since they" \
        "passed (cache $cache), $not_built not compiled by $build/, not checked)"
  fi
fi

# --- Python lint -------------------------------------------------------------------------------
start=$SECONDS
fl=$(first_tool flake8)
if [ "$fix" = 1 ]; then
  :
elif [ -z "$fl" ]; then
  skip flake8 "not installed (scripts/install-deps.sh installs it)"
elif "$fl" "${py_files[@]}"; then
  say "flake8: ${#py_files[@]} files ok ($((SECONDS - start)) s)"
else
  say "flake8: findings above"
  failed+=(flake8)
fi

# --- Python format -----------------------------------------------------------------------------
start=$SECONDS
if formatter black 23 black; then
  bl=$(cat "$tmp/black.tool")
  if [ "$fix" = 1 ]; then
    "$bl" -q --config pyproject.toml "${py_files[@]}"
    say "black applied to ${#py_files[@]} files"
  elif "$bl" --check --config pyproject.toml "${py_files[@]}" 2> "$tmp/black.log"; then
    say "black: ${#py_files[@]} files ok ($((SECONDS - start)) s)"
  else
    head -20 "$tmp/black.log"
    say "black: $(grep -c '^would reformat' "$tmp/black.log") of ${#py_files[@]} files differ (above, up to 20);" \
        "scripts/lint.sh --fix formats them"
    failed+=(black)
  fi
fi

if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: ${failed[*]}${skipped:+ (skipped: ${skipped[*]})}"
  exit 1
fi
say "passed${skipped:+ (skipped: ${skipped[*]})}"
