#!/usr/bin/env bash
# Builds torpor on a GPU machine and runs the GPU tests and benches in one go. Used with the
# device tool (`run`), whose $OUT folder comes back; elsewhere OUT defaults to ./gpu-out.
#
#   scripts/gpu_run.sh [stage ...]     stages: probe doctor tests readme readme-main readme-test bench-sleep bench-sleep-threads python
#                                      bench-first-sleep first-sleep-variance bench-torch-sleep
#                                      bench-engine-first-sleep
#                                      torch-sleep-profile host-store bench-fixed-costs bench-fixed-scenario
#                                      bench-multi-pool
#                                      engines graphs vllm-today tms-examples sglang-sequence
#                                      distributed symmetric symmetric-nccl tail tail-bench stress
#                                      stress-tail soak
#                                      (default: probe tests)
#   TORPOR_GPU_BUILD=dir               the build directory (default build-gpu, type Release);
#   TORPOR_GPU_BUILD_TYPE=type         its build type (default Release); TORPOR_GPU_BUILD=build
#                                      reuses what the readme stage built, saving a build
#   TORPOR_BUILD_TARGETS="a b"         build only these targets (default: everything), to save
#                                      device time when iterating on one part
#   TORPOR_TAIL_BENCH_ARGS="..."       more arguments for torpor_bench_tail (tail, tail-bench),
#                                      e.g. "--blocks-per-row 1 2 4 8 --tokens 1 8 32"
#   TORPOR_README_LIMIT=s              the bound on each README command (readme*, default 590 s)
#   TORPOR_SERVE_SECONDS=s             bench-engine-first-sleep's serving time (default 10)
#
# doctor runs `torpor doctor` (doctor.txt; doctor.json, with the commit like every JSON record):
# the fabric probe's answer with the driver's exact result, the kill switches in force, NCCL.
#
# symmetric and symmetric-nccl need two GPUs (device kind nvidia-h200-x2): two processes, one per
# GPU, symmetric memory through sleep level 2 (`torpor symmetric-check`), the second with the
# bytes over NCCL and a missing-rank timeout plus recovery; they print SKIP and the reason
# otherwise. tail (two GPUs too) runs the MoE tail's GPU tests (two processes, the CPU reference as
# the oracle), the small one again under compute-sanitizer memcheck and racecheck, then the
# fused-vs-unfused bench with its per-phase trace (bench-tail.txt, bench-tail.json); tail-bench runs only
# that bench. stress (1 or 2 GPUs; nvidia-h200-x2
# covers both) runs the runner's kernels against their CPU references, then `torpor stress` on 1
# GPU and on every GPU (threads, then one process per GPU; CUDA graphs), the same with the
# unfused tail (same tokens required), a 50-cycle soak on a model of a few hundred MiB per GPU
# (per-cycle memory returned by cuMemGetInfo), the negative controls (zero-flags on 2 GPUs, stale-weights), and
# `torpor rl-loop`; tables in stress-*.txt, JSON in stress-*.json and rl-loop.json. stress-tail
# (2 GPUs) is the part of stress that checks the tail: one process per GPU with the fused and
# with the unfused tail (the same tokens required), and the negative control. soak (1 GPU) is
# issue 31 item 4's long run: `torpor stress` with 1000 soak cycles (mixed levels, partial wakes)
# on the CLI's default model (as CI's host soak; on stress's larger soak50 model 1000 cycles ran past
# 240 s on one H100), 2 prompts of 4 new tokens per cycle so that the cycles, not the decoding, fill
# the time; the verdict fails on any token that differs and on growth of live physical, host-store
# or mapped bytes, and the table lists the memory cuMemGetInfo reports per cycle; bounded to
# TORPOR_SOAK_LIMIT s (default 280; exit 124 says it ran past, soak-progress.txt how far);
# soak.txt, soak.json.
#
# engines (1 GPU) runs the engine modes of issue 14 with real PyTorch: vLLM's test_cumem.py and
# torch_memory_saver's examples restated (tests/python/test_engines_gpu.py), the vLLM plugin and
# mode tests, and an RL loop through vLLM mode (level 2, reload, wake; RSS, host store bytes and
# the bytes copied to host per iteration: engines-rl-loop.json).
#
# vllm-today (1 GPU) is issue 26's record with real PyTorch: the restated test_cumem.py tests
# (test_engines_gpu.py), the vLLM-today tests and the version matrix (test_vllm_current.py,
# test_vllm_matrix.py: fake torch and the host backend, as in CI), then
# tests/python/vllm_today_gpu.py twice: --policy torpor (an MRV2-style decode graph captured in
# use_cudagraph_pool, sleep(1) and sleep(2) with reload, replayed without re-capture: the same
# tokens; device memory in use awake and asleep from torch.cuda.mem_get_info, the graph pool's
# mapped bytes while asleep, vLLM-style tag hooks in order, the field cases bit-exact) and --policy
# vllm (the field cases' negative control: it must report them lost). vllm-today-*.txt, *.json.
#
# graphs (1 GPU) is issue 16's record: python/examples/graph_decoder.py with the decode graph in
# torpor and, for comparison, captured outside torpor (device memory awake, asleep and after wake,
# split; same greedy tokens after sleep(2) + reload without re-capture; graphs-*.txt, graphs-*.json),
# the graph GPU tests (graphs-pytest.log), then `torpor stress --ranks 1` with its per-rank memory
# report (stress-graphs.txt, stress-graphs.json).
#
# bench-first-sleep runs the sleep bench's first cycle against its targets, unprepared (copies
# pinning first, then again with the copies overlapping the pinning: --overlap-pinning) and with the host store
# prepared during load, then with a pinned limit and the disk tier beyond it
# (spill file under $OUT's disk, removed after). first-sleep-variance runs the unprepared first
# sleep three times in a row with the kernel's huge-page and compaction counters around each
# (vmstat-*.txt, meminfo-*.txt). bench-torch-sleep runs the same scenario through
# torpor.sleep/wake_up and through torch_memory_saver (built from .anchors/torch_memory_saver, so
# run it with .anchors carried) and plots both. torch-sleep-profile (1 GPU) runs that scenario through
# torpor only, with the Python path's time split by step (bench/torch_sleep_profile.py: each step of
# sleep and wake_up, garbage collections, the primitives a cheaper path could use, a cProfile top 30;
# torch-sleep-profile.txt, .json, -cprofile.txt). host-store runs the host-store and spill tests on
# the GPU (registration, O_DIRECT detection: the log says which path ran).
#
# tms-examples (1 GPU; the multi-device examples need 2: nvidia-h200-x2 runs them too, else they
# SKIP) runs torch_memory_saver's own test/examples/ through its own test/test_examples.py, both
# unmodified, against torpor.tms in both hook modes (its harness parametrizes them; preload mode
# through torpor.tms.configure_subprocess, i.e. libtorpor_preload.so on LD_PRELOAD). The copy
# comes from TORPOR_TMS_SRC (a torch_memory_saver checkout in an ignored folder, e.g.
# .anchors/torch_memory_saver carried along); the stage fails naming it when it is absent. Each
# example and mode with its result: tms-examples.txt (pytest's log in tms-examples.log).
# sglang-sequence (1 GPU) runs SGLang's release / update / resume sequence with real PyTorch
# (tests/python/sglang_gpu_sequence.py): torpor with torpor.sglang.register_model (buffers exact
# before the stash), the control under torch_memory_saver's policy, and torch_memory_saver itself
# when TORPOR_TMS_SRC builds (its figures beside torpor's): sglang-*.json, sglang-sequence.txt.
# bench-fixed-costs (1 GPU) is issue 30's fixed-cost record: torpor_bench_fixed sweeps 100 to
# 10,000 one-granule chunks and reports each phase (unchanged L1 sleep, L1 wake, L2 sleep, L2 wake)
# per chunk and per call, beside the floor of each driver call timed in the same run
# (bench-fixed-costs.txt, .json, and the plot bench-fixed-costs.png). bench-fixed-scenario (1 GPU)
# is the same record on issue 3's scenario (103 chunks, the host store prepared, 4 cycles, each
# step's phases): with TORPOR_BASELINE_SRC=dir (an older tree, e.g. `git archive` of the commit
# before a change unpacked under the ignored .anchors/ and carried) that tree's bench is built
# too and the two run alternately, twice each, on the same machine, with ours once more after the
# first pair with --settle 1 (bench-fixed-scenario-N-{baseline,ours,settled}.txt, .json). bench-multi-pool (any
# number of GPUs; on one, N pools share it)
# sleeps and wakes 1, 2, 4 and 8 pools at once from threads and sets the aggregate rate beside the
# host's own memcpy bandwidth measured in the same process (bench-multi-pool.txt, .json).
#
# distributed (2 GPUs; nvidia-h200-x2) runs torpor.distributed over a real torch.distributed group,
# gloo and nccl, one process per GPU (tests/python/test_distributed_gpu.py; SKIP with one GPU).
#
# The multicast kill switches are always set: these machines are shared, and a multicast
# object can take their GPUs out of service. torpor honours every one of them.
set -uo pipefail
cd "$(dirname "$0")/.."
export TORPOR_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/gpu-out}
build=${TORPOR_GPU_BUILD:-build-gpu}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(probe tests)
status=0

{
  echo "commit: ${TORPOR_COMMIT:-unknown}"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  cmake --version | head -1
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# Built once, before the first stage that needs it (readme builds its own build/).
built=0
ensure_built() {
  [ $built = 1 ] && return 0
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${TORPOR_GPU_BUILD_TYPE:-Release}" > "$OUT/configure.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" ${TORPOR_BUILD_TARGETS:+--target $TORPOR_BUILD_TARGETS} > "$OUT/build.log" 2>&1 || {
      echo "build failed"; tail -n 40 "$OUT/configure.log" "$OUT/build.log"; exit 1; }
  built=1
}

# The README's n-th sh block (1: the main command, 2: the test command), as the README writes it.
readme_block() {
  awk -v want="$1" '/^```sh$/ {n++; next} /^```$/ {if (n == want) exit} n == want' README.md
}

# The fused-vs-unfused tail bench with its per-phase trace (stages tail and tail-bench).
tail_bench() {
  timeout 240 $build/bench/torpor_bench_tail --trace --json "$OUT/bench-tail.json" ${TORPOR_TAIL_BENCH_ARGS:-} > "$OUT/bench-tail.txt" 2>&1 || status=1
  cat "$OUT/bench-tail.txt"
}

# `torpor stress` on the GPUs, bounded: name, limit, args...
run_stress() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" $build/tools/torpor stress --backend cuda --no-progress --json "$OUT/stress-$name.json" "$@" \
    > "$OUT/stress-$name.txt" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && status=1
  echo "== torpor stress $* (exit $rc)"; cat "$OUT/stress-$name.txt"
}
# Fused and unfused tails on every GPU, one process each, must give the same tokens.
stress_fused_unfused() {
  run_stress processes 120 --ranks 2 --processes
  run_stress unfused 120 --ranks 2 --processes --unfused
  local digests
  digests=$(grep -ho '"reference_digest": "[0-9a-f]*"' "$OUT/stress-processes.json" "$OUT/stress-unfused.json" | sort -u | wc -l)
  echo "fused and unfused tails: $([ "$digests" -eq 1 ] && echo 'same tokens' || { status=1; echo 'DIFFERENT tokens'; })"
}
# Must fail (non-zero exit), naming the rank and the op, within the wait bound plus seconds.
stress_negative_control() {
  timeout 90 $build/tools/torpor stress --backend cuda --no-progress --ranks 2 --processes --negative-control zero-flags \
    --json "$OUT/stress-negative.json" > "$OUT/stress-negative.txt" 2>&1
  local rc=$?
  echo "== negative control (exit $rc: $([ $rc -ne 0 ] && [ $rc -ne 124 ] && echo 'failed as required' || { status=1; echo 'WRONG'; }))"
  cat "$OUT/stress-negative.txt"
}

# Must fail (non-zero exit): level 2 keeps every parameter while the weight version advances, so
# the outputs differ from a freshly built model's.
stress_stale_weights() {
  timeout 120 $build/tools/torpor stress --backend cuda --no-progress --ranks "$1" --negative-control stale-weights \
    --json "$OUT/stress-stale-weights.json" > "$OUT/stress-stale-weights.txt" 2>&1
  local rc=$?
  echo "== negative control stale-weights (exit $rc: $([ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'prompts match a freshly built model' "$OUT/stress-stale-weights.txt" && echo 'failed as required' || { status=1; echo 'WRONG'; }))"
  tail -8 "$OUT/stress-stale-weights.txt"
}

for stage in "${stages[@]}"; do
  # tms-examples without its source fails at once, before a build it cannot use
  case "$stage" in readme*) needs_build=0 ;; *) needs_build=1 ;; esac
  [ $needs_build = 0 ] || { [ "$stage" = tms-examples ] && [ ! -f "${TORPOR_TMS_SRC:-}/test/test_examples.py" ]; } ||
    ensure_built
  case "$stage" in
    probe)
      $build/tools/torpor probe --json > "$OUT/probe.json" || status=1
      $build/tools/torpor probe || status=1
      ;;
    doctor)
      # Its exit status is its verdict (0 full speed, 1 slow or limited, 2 no usable GPU); only a
      # usage error (above 2) fails the stage. The JSON gets the commit below, as every record.
      $build/tools/torpor doctor --json > "$OUT/doctor.json"
      [ $? -gt 2 ] && status=1
      $build/tools/torpor doctor | tee "$OUT/doctor.txt"
      ;;
    tests)
      # Host-backend tests in parallel; cuda-typed tests one at a time, since some of them
      # read the device's free memory.
      # (TailCuda, GpuTail: the tail stage runs those, one at a time; TailCuda on two GPUs.)
      ctest --test-dir $build -j 8 -E 'CudaBackend|TailCuda|GpuTail' --output-on-failure > "$OUT/ctest-host.log" 2>&1 || status=1
      $build/tests/torpor_tests --gtest_filter='*/cuda.*' --gtest_brief=0 > "$OUT/gtest-cuda.log" 2>&1 || status=1
      grep -E "tests passed|tests failed" "$OUT/ctest-host.log"
      grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/gtest-cuda.log" | sort | uniq -c | sort -rn | head -40
      tail -3 "$OUT/gtest-cuda.log"
      ;;
    readme|readme-main|readme-test)
      # The README's two commands as they are (issue 28: green on a GPU machine, timed), in a
      # checkout of their own builds (build/, build-asan/, build-tsan/; build-fuzz/ of older trees), removed first
      # so that each starts as from a fresh copy. readme runs both; the device tool's 10-minute
      # limit per call may need readme-main and readme-test in two calls.
      if [ "$stage" != readme-test ]; then
        rm -rf build build-asan build-tsan build-fuzz
        # The main command as the README writes it (its first sh block).
        main_command=$(readme_block 1)
        started=$SECONDS
        ( timeout "${TORPOR_README_LIMIT:-590}" bash -c "$main_command" ) > "$OUT/readme-main.log" 2>&1 || status=1
        echo "== README main command ($((SECONDS - started)) s): $main_command" | tee "$OUT/readme-main-summary.txt"
        grep -E "PASS|FAIL" "$OUT/readme-main.log" | tail -3 | tee -a "$OUT/readme-main-summary.txt"
      fi
      if [ "$stage" != readme-main ]; then
        rm -rf build build-asan build-tsan build-fuzz
        test_command=$(readme_block 2)
        started=$SECONDS
        ( timeout "${TORPOR_README_LIMIT:-590}" bash -c "$test_command" ) > "$OUT/readme.log" 2>&1 || status=1
        { echo "== README test command ($((SECONDS - started)) s): $test_command"
          grep -E "install-deps:|tests passed|tests failed|torpor: stage|torpor: all tests passed|\*\*\*Failed|Timeout|check_wheel:|lint:" "$OUT/readme.log" | tail -40
        } | tee "$OUT/readme-summary.txt"
      fi
      ;;
    bench-sleep)
      # Issue 3's scenario: 32 GiB of parameters in 2048 x 16 MiB, 256 MiB of state, 16 GiB of cache.
      $build/bench/torpor_bench_sleep --json "$OUT/bench-sleep.json" > "$OUT/bench-sleep.txt" 2>&1 || status=1
      cat "$OUT/bench-sleep.txt"
      ;;
    bench-sleep-threads)
      # The release-thread count, compared on the same scenario (no baseline, 3 cycles each).
      for t in 1 4; do
        $build/bench/torpor_bench_sleep --no-baseline --cycles 3 --release-threads "$t" \
          --json "$OUT/bench-sleep-threads$t.json" > "$OUT/bench-sleep-threads$t.txt" 2>&1 || status=1
        echo "release threads $t:"; grep -E "^cycle|L1 sleep \(unchanged\)|L2 sleep|L2 wake" "$OUT/bench-sleep-threads$t.txt"
      done
      ;;
    bench-fixed-scenario)
      # "settled": ours with a second's pause before each step: what is left is torpor's and the
      # driver's cost of the step itself, not the driver's work on memory the step before freed.
      runs=(ours settled)
      if [ -n "${TORPOR_BASELINE_SRC:-}" ]; then
        { cmake -S "$TORPOR_BASELINE_SRC" -B build-baseline -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/baseline-configure.log" 2>&1 &&
            cmake --build build-baseline -j "$(nproc)" --target torpor_bench_sleep > "$OUT/baseline-build.log" 2>&1 &&
            runs=(baseline ours settled baseline ours); } || { echo "baseline build failed"; tail -n 20 "$OUT/baseline-build.log"; status=1; }
      fi
      n=0
      for who in "${runs[@]}"; do
        n=$((n + 1))
        bin=$build/bench/torpor_bench_sleep args=(--cycles 4)
        [ "$who" = baseline ] && bin=build-baseline/bench/torpor_bench_sleep
        [ "$who" = settled ] && args=(--cycles 3 --settle 1)
        timeout 200 $bin --no-baseline --prepare "${args[@]}" --json "$OUT/bench-fixed-scenario-$n-$who.json" \
          > "$OUT/bench-fixed-scenario-$n-$who.txt" 2>&1 || status=1
        echo "== $n $who:"
        grep -E "^cycle [34]|cycle [34] .*phases:|^torpor L|issue30" "$OUT/bench-fixed-scenario-$n-$who.txt"
      done
      ;;
    bench-first-sleep)
      # unprepared: all the pinning, then the copies (the default); unprepared-overlap: the other
      # arrangement (--overlap-pinning), in the same run, so the record says which is faster.
      for variant in unprepared unprepared-overlap prepared; do
        case $variant in
          prepared) flag=--prepare ;;
          unprepared-overlap) flag=--overlap-pinning ;;
          *) flag= ;;
        esac
        TORPOR_LOG=info timeout 300 $build/bench/torpor_bench_sleep --no-baseline --cycles 2 $flag \
          --json "$OUT/bench-first-sleep-$variant.json" > "$OUT/bench-first-sleep-$variant.txt" 2>&1 || status=1
        echo "== first sleep, $variant:"
        grep -E "host store|^cycle|phases:|first_l1_sleep|l1_sleep_of_ceiling|l1_wake_of_ceiling|unchanged_sleep|issue30" \
          "$OUT/bench-first-sleep-$variant.txt"
      done
      spill=$(mktemp -d "$PWD/spill.XXXXXX")
      TORPOR_LOG=info timeout 300 $build/bench/torpor_bench_sleep --no-baseline --cycles 2 --host-store-limit 16G \
        --spill-dir "$spill" --json "$OUT/bench-first-sleep-spill.json" > "$OUT/bench-first-sleep-spill.txt" 2>&1 || status=1
      # The disk's own bandwidth, for the spill figures: 8 GiB written and read back with O_DIRECT
      # in 64 MiB requests, in the same directory (dd, independent of torpor).
      { timeout 120 dd if=/dev/zero of="$spill/baseline" bs=64M count=128 oflag=direct conv=fsync 2>&1 | tail -1 |
          sed 's/^/disk baseline write (dd O_DIRECT): /'
        timeout 120 dd if="$spill/baseline" of=/dev/null bs=64M iflag=direct 2>&1 | tail -1 |
          sed 's/^/disk baseline read (dd O_DIRECT): /'; } > "$OUT/disk-baseline.txt" 2>&1 || status=1
      rm -rf "$spill"
      echo "== 16 GiB pinned, the rest on disk:"
      grep -E "spill|^host store|^cycle|first_l1_sleep|torpor L1" "$OUT/bench-first-sleep-spill.txt"
      cat "$OUT/disk-baseline.txt"
      ;;
    bench-fixed-costs)
      timeout 540 $build/bench/torpor_bench_fixed --json "$OUT/bench-fixed-costs.json" \
        > "$OUT/bench-fixed-costs.txt" 2>&1 || status=1
      cat "$OUT/bench-fixed-costs.txt"
      python3 bench/plot_fixed_costs.py "$OUT/bench-fixed-costs.json" -o "$OUT/bench-fixed-costs.png" ||
        echo "(plot skipped)"
      ;;
    bench-multi-pool)
      # 4 GiB per pool: 8 pools hold 32 GiB of device memory and 32 GiB of pinned host store.
      timeout 540 $build/bench/torpor_bench_multi --pools 1 2 4 8 --bytes 4G --json "$OUT/bench-multi-pool.json" \
        > "$OUT/bench-multi-pool.txt" 2>&1 || status=1
      cat "$OUT/bench-multi-pool.txt"
      ;;
    first-sleep-variance)
      # The unprepared first sleep, three times in a row, each with the kernel's huge-page and
      # compaction counters before and after (/proc/vmstat) and the free memory: what makes the
      # pinning of the host store faster in one process than in the next.
      for i in 1 2 3; do
        grep -E '^(thp_fault_alloc|thp_fault_fallback|thp_fault_fallback_charge|compact_stall|compact_fail|compact_success|pgmajfault|allocstall_normal|allocstall_movable) ' \
          /proc/vmstat > "$OUT/vmstat-before-$i.txt"
        grep -E '^(MemFree|MemAvailable|AnonHugePages|Cached|Buffers):' /proc/meminfo > "$OUT/meminfo-before-$i.txt"
        TORPOR_LOG=info timeout 200 $build/bench/torpor_bench_sleep --no-baseline --cycles 1 \
          --json "$OUT/first-sleep-variance-$i.json" > "$OUT/first-sleep-variance-$i.txt" 2>&1 || status=1
        grep -E '^(thp_fault_alloc|thp_fault_fallback|thp_fault_fallback_charge|compact_stall|compact_fail|compact_success|pgmajfault|allocstall_normal|allocstall_movable) ' \
          /proc/vmstat > "$OUT/vmstat-after-$i.txt"
        echo "== unprepared first sleep, run $i:"
        grep -E "^cycle|first_l1_sleep" "$OUT/first-sleep-variance-$i.txt"
        cat "$OUT/meminfo-before-$i.txt" | tr '\n' ' '; echo
        join "$OUT/vmstat-before-$i.txt" "$OUT/vmstat-after-$i.txt" | awk '{printf "%s +%d  ", $1, $3 - $2} END {print ""}'
      done
      ;;
    bench-torch-sleep)
      tms_dir=$PWD/$build/tms
      if [ ! -d "$tms_dir/torch_memory_saver" ]; then
        TMS_CUDA_MAJOR=13 timeout 300 python3 -m pip install --no-build-isolation --no-deps --no-index \
          --target "$tms_dir" .anchors/torch_memory_saver > "$OUT/tms-build.log" 2>&1 ||
          { echo "torch_memory_saver build failed (tms-build.log); its rows will say skipped"; tail -5 "$OUT/tms-build.log"; }
      fi
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python:$tms_dir"
        PYTHONDONTWRITEBYTECODE=1)
      # unprepared: all the pinning, then the copies (the default); unprepared-overlap: the other
      # arrangement (--overlap-pinning), in the same run, so the record says which is faster.
      for variant in unprepared unprepared-overlap prepared; do
        case $variant in
          prepared) flag=--prepare ;;
          unprepared-overlap) flag=--overlap-pinning ;;
          *) flag= ;;
        esac
        engines=$([ "$variant" = prepared ] && echo torpor || echo torpor,tms)
        timeout 540 "${pyenv[@]}" python3 bench/torch_sleep_bench.py --engines "$engines" --cycles 3 $flag \
          --json "$OUT/bench-torch-sleep-$variant.json" > "$OUT/bench-torch-sleep-$variant.txt" 2>&1 || status=1
        echo "== PyTorch path, $variant:"; cat "$OUT/bench-torch-sleep-$variant.txt"
        python3 bench/plot_torch_sleep.py "$OUT/bench-torch-sleep-$variant.json" -o "$OUT/bench-torch-sleep-$variant.png" ||
          echo "(plot skipped)"
      done
      ;;
    bench-engine-first-sleep)
      # Issue 30 item 1: the first sleep through torpor's vLLM and torch_memory_saver modes with
      # their default preparation (TORPOR_PREPARE_SLEEP=auto), the engine serving
      # TORPOR_SERVE_SECONDS (default 10) between its load and its first sleep, against the
      # steady sleeps of the same process.
      timeout 400 env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1 \
        python3 bench/torch_sleep_bench.py --engines torpor-vllm,torpor-tms --cycles 3 \
        --serve-seconds "${TORPOR_SERVE_SECONDS:-10}" --json "$OUT/bench-engine-first-sleep.json" \
        > "$OUT/bench-engine-first-sleep.txt" 2>&1 || status=1
      cat "$OUT/bench-engine-first-sleep.txt"
      ;;
    torch-sleep-profile)
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      timeout 400 "${pyenv[@]}" python3 bench/torch_sleep_profile.py --cycles 4 --json "$OUT/torch-sleep-profile.json" \
        --cprofile "$OUT/torch-sleep-profile-cprofile.txt" > "$OUT/torch-sleep-profile.txt" 2>&1 || status=1
      cat "$OUT/torch-sleep-profile.txt"
      ;;
    host-store)
      TORPOR_LOG=info timeout 300 $build/tests/torpor_tests --gtest_filter='*HostStore*:*Spill*' > "$OUT/host-store-tests.log" 2>&1 ||
        status=1
      grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|direct I/O|O_DIRECT|registration" "$OUT/host-store-tests.log" | head -60
      tail -3 "$OUT/host-store-tests.log"
      ;;
    python)
      # The Python package with PyTorch on the GPU: each tests/python file in its own process
      # (the PyTorch pools' options are per process; host-backend files run too), then the
      # RL weight-update loop.
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      "${pyenv[@]}" python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 |
        tee -a "$OUT/machine.txt"
      : > "$OUT/pytest.log"
      for f in tests/python/test_*.py; do
        "${pyenv[@]}" python3 -m pytest -v -s -rs -p no:cacheprovider "$f" >> "$OUT/pytest.log" 2>&1 || status=1
      done
      grep -E "^=+ .*(passed|failed|skipped|error).* in .*=+$|^(FAILED|ERROR|SKIPPED) |torpor pools mapped" "$OUT/pytest.log"
      "${pyenv[@]}" python3 python/examples/rl_loop.py --iterations 3 --json "$OUT/rl_loop.json" 2>&1 |
        tee "$OUT/rl_loop.txt" || status=1
      ;;
    engines)
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      : > "$OUT/engines-pytest.log"
      for f in test_engines_gpu.py test_vllm_mode.py test_vllm_plugin.py test_tms_mode.py test_pool_memory.py; do
        timeout 300 "${pyenv[@]}" python3 -m pytest -v -s -rs -p no:cacheprovider "tests/python/$f" \
          >> "$OUT/engines-pytest.log" 2>&1 || status=1
      done
      grep -E "^=+ .*(passed|failed|skipped|error).* in .*=+$|^(FAILED|ERROR|SKIPPED) " "$OUT/engines-pytest.log"
      timeout 300 "${pyenv[@]}" python3 tests/python/engines_rl_loop.py --iterations 5 \
        --json "$OUT/engines-rl-loop.json" 2>&1 | tee "$OUT/engines-rl-loop.txt"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      ;;
    vllm-today)
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      : > "$OUT/vllm-today-pytest.log"
      for f in test_engines_gpu.py test_vllm_current.py test_vllm_matrix.py; do
        timeout 300 "${pyenv[@]}" python3 -m pytest -v -s -rs -p no:cacheprovider "tests/python/$f" \
          >> "$OUT/vllm-today-pytest.log" 2>&1 || status=1
      done
      grep -E "^=+ .*(passed|failed|skipped|error).* in .*=+$|^(FAILED|ERROR|SKIPPED) " "$OUT/vllm-today-pytest.log"
      for policy in torpor vllm; do
        echo "== vllm_today_gpu.py --policy $policy"
        timeout 300 "${pyenv[@]}" python3 tests/python/vllm_today_gpu.py --policy "$policy" \
          --json "$OUT/vllm-today-$policy.json" 2>&1 | tee "$OUT/vllm-today-$policy.txt"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done
      ;;
    distributed)
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      timeout 420 "${pyenv[@]}" python3 -m pytest -v -s -rs -p no:cacheprovider tests/python/test_distributed_gpu.py \
        > "$OUT/distributed-pytest.log" 2>&1 || status=1
      grep -E "^=+ .*(passed|failed|skipped|error).* in .*=+$|^(FAILED|ERROR|SKIPPED) " "$OUT/distributed-pytest.log"
      ;;
    symmetric)
      $build/tools/torpor symmetric-check --backend cuda --ranks 2 --bytes 4G --json "$OUT/symmetric.json" \
        > "$OUT/symmetric.txt" 2>&1 || status=1
      cat "$OUT/symmetric.txt"
      ;;
    symmetric-nccl)
      $build/tools/torpor symmetric-check --backend cuda --ranks 2 --bytes 1G --group nccl --timeout 10 \
        --timeout-check --json "$OUT/symmetric-nccl.json" > "$OUT/symmetric-nccl.txt" 2>&1 || status=1
      cat "$OUT/symmetric-nccl.txt"
      ;;
    tail)
      # Each step is bounded, so a hang cannot eat the machine's time (expected: ~1 min each).
      sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      timeout 360 $build/tests/torpor_fusion_tests --gtest_filter='GpuTail.*:TailCuda.*' > "$OUT/tail-tests.log" 2>&1 || status=1
      grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|Skipped|Failure|rank [0-9]" "$OUT/tail-tests.log" | head -40
      tail -3 "$OUT/tail-tests.log"
      # One sanitizer per rank (each the process that runs the kernels), meeting at a rendezvous
      # made here: TORPOR_RANK / TORPOR_GROUP_RENDEZVOUS make the test run as that one rank.
      for tool in memcheck racecheck; do
        rv_dir=$(mktemp -d) && chmod 700 "$rv_dir"
        rv="$rv_dir#$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"
        pids=()
        for r in 0 1; do
          TORPOR_GROUP_RENDEZVOUS="$rv" TORPOR_RANK=$r TORPOR_WORLD_SIZE=2 timeout 150 "$sanitizer" --tool "$tool" \
            --error-exitcode 86 $build/tests/torpor_fusion_tests --gtest_filter='TailCuda.SanitizerSmoke' \
            > "$OUT/tail-$tool-rank$r.log" 2>&1 &
          pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || status=1; done
        rm -rf "$rv_dir"
        for r in 0 1; do
          echo "compute-sanitizer $tool rank $r: $(grep -hE "(ERROR|RACECHECK) SUMMARY" "$OUT/tail-$tool-rank$r.log" | tr -s ' =' ' ')" \
            "$(grep -cE "^\[ +OK +\] TailCuda.SanitizerSmoke" "$OUT/tail-$tool-rank$r.log") passed"
        done
      done
      tail_bench
      ;;
    tail-bench)
      tail_bench
      ;;
    stress)
      # Every step is bounded (timeout), so a hang cannot eat the machine's time.
      t=$build/tools/torpor
      gpus=$(nvidia-smi -L | wc -l)
      timeout 120 $build/tests/torpor_fusion_tests --gtest_filter='GpuKernels.*' > "$OUT/stress-kernels.log" 2>&1 || status=1
      grep -E "^\[ +(OK|FAILED|SKIPPED) +\]" "$OUT/stress-kernels.log"
      run_stress 1gpu 120 --ranks 1
      if [ "$gpus" -ge 2 ]; then
        run_stress threads 120 --ranks 2
        stress_fused_unfused
      fi
      ranks=$([ "$gpus" -ge 2 ] && echo 2 || echo 1)
      run_stress soak50 420 --ranks "$ranks" --processes --cycles 50 --vocab 32768 --hidden 1024 --layers 4 \
        --head-dim 128 --experts 16 --latent 256 --inter 2048 --shared-inter 2048
      [ "$gpus" -ge 2 ] && stress_negative_control
      stress_stale_weights "$ranks"
      timeout 240 "$t" rl-loop --backend cuda --no-progress --ranks "$ranks" --processes --iterations 3 \
        --vocab 32768 --hidden 1024 --layers 4 --head-dim 128 --experts 16 --latent 256 --inter 2048 \
        --shared-inter 2048 --json "$OUT/rl-loop.json" > "$OUT/rl-loop.txt" 2>&1 || status=1
      echo "== torpor rl-loop"; cat "$OUT/rl-loop.txt"
      ;;
    soak)
      # The CLI's default model (as CI's 200-cycle host soak): the cycles, not the model, are what
      # this run is for. Progress lines go to soak-progress.txt, so a run stopped at the bound
      # still says how far it got.
      # (the progress line needs a terminal: util-linux's script gives it one where present)
      soak_cmd="timeout ${TORPOR_SOAK_LIMIT:-280} $build/tools/torpor stress --backend cuda --ranks 1 --cycles 1000 \
        --prompts 2 --new-tokens 4 --json $OUT/soak.json > $OUT/soak.txt"
      if command -v script > /dev/null; then
        script -qfec "$soak_cmd" "$OUT/soak-progress.txt" > /dev/null
      else
        bash -c "$soak_cmd" 2> "$OUT/soak-progress.txt"
      fi
      rc=$?
      [ $rc -ne 0 ] && status=1
      echo "== torpor stress, 1000-cycle soak on 1 GPU (exit $rc$([ $rc -eq 124 ] && echo ": ran past ${TORPOR_SOAK_LIMIT:-280} s"))"
      tr '\r' '\n' < "$OUT/soak-progress.txt" | grep -a 'step' | tail -1
      grep -E "soak|PASS|FAIL|device memory|outside torpor" "$OUT/soak.txt" | tail -20
      ;;
    stress-tail)
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        stress_fused_unfused
        stress_negative_control
      else
        echo "SKIP stress-tail: needs two GPUs (device kind nvidia-h200-x2)"
      fi
      ;;
    graphs)
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      for mode in torpor outside; do
        timeout 300 "${pyenv[@]}" python3 python/examples/graph_decoder.py --graphs "$mode" \
          --json "$OUT/graphs-$mode.json" > "$OUT/graphs-$mode.txt" 2>&1 || status=1
        echo "== graph_decoder.py --graphs $mode"; cat "$OUT/graphs-$mode.txt"
      done
      timeout 300 "${pyenv[@]}" python3 -m pytest -v -s -rs -p no:cacheprovider tests/python/test_graphs_gpu.py \
        > "$OUT/graphs-pytest.log" 2>&1 || status=1
      grep -E "^=+ .*(passed|failed|skipped|error).* in .*=+$|^(FAILED|ERROR|SKIPPED) |graph pool|outside torpor" \
        "$OUT/graphs-pytest.log"
      run_stress graphs 120 --ranks 1
      ;;
    tms-examples)
      if [ -z "${TORPOR_TMS_SRC:-}" ] || [ ! -f "${TORPOR_TMS_SRC}/test/test_examples.py" ]; then
        echo "tms-examples: TORPOR_TMS_SRC='${TORPOR_TMS_SRC:-}' is not a torch_memory_saver checkout with" \
          "test/test_examples.py: bring one into an ignored folder (e.g. .anchors/torch_memory_saver, carried)" \
          "and set TORPOR_TMS_SRC to it"
        status=1
      else
        ensure_built
        work=$PWD/$build/tms-examples
        rm -rf "$work" && cp -r "$TORPOR_TMS_SRC/test" "$work"  # a copy: pytest writes beside the files
        pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so"
          PYTHONPATH="$PWD/python/torpor/_shims:$PWD/python" PYTHONDONTWRITEBYTECODE=1)
        (cd "$work" && timeout 560 "${pyenv[@]}" python3 -m pytest -v -rs -p no:cacheprovider test_examples.py \
          --junitxml="$OUT/tms-examples.xml") > "$OUT/tms-examples.log" 2>&1 || status=1
        python3 - "$OUT/tms-examples.xml" > "$OUT/tms-examples.txt" <<'EOF3' || status=1
import sys
import xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    result = "passed"
    for kind in ("failure", "error", "skipped"):
        node = case.find(kind)
        if node is not None:
            result = f"{kind}: {(node.get('message') or '').splitlines()[0][:160] if node.get('message') else ''}"
    print(f"{case.get('name'):60s} {result}")
EOF3
        cat "$OUT/tms-examples.txt"
        tail -3 "$OUT/tms-examples.log"
      fi
      ;;
    sglang-sequence)
      ensure_built
      pyenv=(env TORPOR_LIBRARY="$PWD/$build/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      : > "$OUT/sglang-sequence.txt"
      for engine in torpor torpor-tms-policy; do
        timeout 300 "${pyenv[@]}" python3 tests/python/sglang_gpu_sequence.py --engine "$engine" \
          --json "$OUT/sglang-$engine.json" >> "$OUT/sglang-sequence.txt" 2>&1 || status=1
      done
      tms_dir=$PWD/$build/tms
      if [ -n "${TORPOR_TMS_SRC:-}" ] && [ ! -d "$tms_dir/torch_memory_saver" ]; then
        TMS_CUDA_MAJOR=13 timeout 300 python3 -m pip install --no-build-isolation --no-deps --no-index \
          --target "$tms_dir" "$TORPOR_TMS_SRC" > "$OUT/tms-build.log" 2>&1 || echo "torch_memory_saver build failed (tms-build.log)"
      fi
      if [ -d "$tms_dir/torch_memory_saver" ]; then
        timeout 300 env PYTHONPATH="$tms_dir" PYTHONDONTWRITEBYTECODE=1 python3 tests/python/sglang_gpu_sequence.py \
          --engine tms --json "$OUT/sglang-tms.json" >> "$OUT/sglang-sequence.txt" 2>&1 || status=1
      else
        echo "sglang-sequence: torch_memory_saver not built (set TORPOR_TMS_SRC): its row is skipped" | tee -a "$OUT/sglang-sequence.txt"
      fi
      cat "$OUT/sglang-sequence.txt"
      ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
# A record names the code it measured: every JSON object written under $OUT without a top-level
# "commit" (torpor stress, rl-loop, symmetric-check write none) gets TORPOR_COMMIT's.
if [ -n "${TORPOR_COMMIT:-}" ]; then
  python3 - "$OUT" "$TORPOR_COMMIT" <<'EOF2' || status=1
import json, pathlib, sys
out, commit = pathlib.Path(sys.argv[1]), sys.argv[2]
for path in sorted(out.rglob("*.json")):
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        continue  # not a whole JSON document (a run cut short): left as it is
    if isinstance(doc, dict) and "commit" not in doc:
        path.write_text(json.dumps({"commit": commit, **doc}, indent=1) + "\n")
EOF2
fi
exit $status
