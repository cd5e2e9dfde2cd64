#!/usr/bin/env bash
# Builds torpor on a GPU machine and runs the GPU tests and benches in one go. Used with the
# device tool (`run`), whose $OUT folder comes back; elsewhere OUT defaults to ./gpu-out.
#
#   scripts/gpu_run.sh [stage ...]     stages: probe tests bench-sleep bench-sleep-threads python engines
#                                      distributed symmetric symmetric-nccl tail tail-bench stress stress-tail
#                                      (default: probe tests)
#   TORPOR_BUILD_TARGETS="a b"         build only these targets (default: everything), to save
#                                      device time when iterating on one part
#   TORPOR_TAIL_BENCH_ARGS="..."       more arguments for torpor_bench_tail (tail, tail-bench),
#                                      e.g. "--blocks-per-row 1 2 4 8 --tokens 1 8 32"
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
# (per-cycle memory returned by cuMemGetInfo), the negative control (2 GPUs), and
# `torpor rl-loop`; tables in stress-*.txt, JSON in stress-*.json and rl-loop.json. stress-tail
# (2 GPUs) is the part of stress that checks the tail: one process per GPU with the fused and
# with the unfused tail (the same tokens required), and the negative control.
#
# engines (1 GPU) runs the engine modes of issue 14 with real PyTorch: vLLM's test_cumem.py and
# torch_memory_saver's examples restated (tests/python/test_engines_gpu.py), the vLLM plugin and
# mode tests, and an RL loop through vLLM mode (level 2, reload, wake; RSS, host store bytes and
# the bytes copied to host per iteration: engines-rl-loop.json).
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

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/configure.log" 2>&1 &&
  cmake --build build-gpu -j "$(nproc)" ${TORPOR_BUILD_TARGETS:+--target $TORPOR_BUILD_TARGETS} > "$OUT/build.log" 2>&1 || {
    echo "build failed"; tail -40 "$OUT/configure.log" "$OUT/build.log"; exit 1; }

# The fused-vs-unfused tail bench with its per-phase trace (stages tail and tail-bench).
tail_bench() {
  timeout 240 build-gpu/bench/torpor_bench_tail --trace --json "$OUT/bench-tail.json" ${TORPOR_TAIL_BENCH_ARGS:-} > "$OUT/bench-tail.txt" 2>&1 || status=1
  cat "$OUT/bench-tail.txt"
}

# `torpor stress` on the GPUs, bounded: name, limit, args...
run_stress() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" build-gpu/tools/torpor stress --backend cuda --no-progress --json "$OUT/stress-$name.json" "$@" \
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
  timeout 90 build-gpu/tools/torpor stress --backend cuda --no-progress --ranks 2 --processes --negative-control zero-flags \
    --json "$OUT/stress-negative.json" > "$OUT/stress-negative.txt" 2>&1
  local rc=$?
  echo "== negative control (exit $rc: $([ $rc -ne 0 ] && [ $rc -ne 124 ] && echo 'failed as required' || { status=1; echo 'WRONG'; }))"
  cat "$OUT/stress-negative.txt"
}

for stage in "${stages[@]}"; do
  case "$stage" in
    probe)
      build-gpu/tools/torpor probe --json > "$OUT/probe.json" || status=1
      build-gpu/tools/torpor probe || status=1
      ;;
    tests)
      # Host-backend tests in parallel; cuda-typed tests one at a time, since some of them
      # read the device's free memory.
      # (TailCuda: the tail stage runs those, one at a time, on two GPUs.)
      ctest --test-dir build-gpu -j 8 -E 'CudaBackend|TailCuda' --output-on-failure > "$OUT/ctest-host.log" 2>&1 || status=1
      build-gpu/tests/torpor_tests --gtest_filter='*/cuda.*' --gtest_brief=0 > "$OUT/gtest-cuda.log" 2>&1 || status=1
      grep -E "tests passed|tests failed" "$OUT/ctest-host.log"
      grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/gtest-cuda.log" | sort | uniq -c | sort -rn | head -40
      tail -3 "$OUT/gtest-cuda.log"
      ;;
    bench-sleep)
      # Issue 3's scenario: 32 GiB of parameters in 2048 x 16 MiB, 256 MiB of state, 16 GiB of cache.
      build-gpu/bench/torpor_bench_sleep --json "$OUT/bench-sleep.json" > "$OUT/bench-sleep.txt" 2>&1 || status=1
      cat "$OUT/bench-sleep.txt"
      ;;
    bench-sleep-threads)
      # The release-thread count, compared on the same scenario (no baseline, 3 cycles each).
      for t in 1 4; do
        build-gpu/bench/torpor_bench_sleep --no-baseline --cycles 3 --release-threads "$t" \
          --json "$OUT/bench-sleep-threads$t.json" > "$OUT/bench-sleep-threads$t.txt" 2>&1 || status=1
        echo "release threads $t:"; grep -E "^cycle|L1 sleep \(unchanged\)|L2 sleep|L2 wake" "$OUT/bench-sleep-threads$t.txt"
      done
      ;;
    python)
      # The Python package with PyTorch on the GPU: each tests/python file in its own process
      # (the PyTorch pools' options are per process; host-backend files run too), then the
      # RL weight-update loop.
      pyenv=(env TORPOR_LIBRARY="$PWD/build-gpu/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
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
      pyenv=(env TORPOR_LIBRARY="$PWD/build-gpu/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
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
    distributed)
      pyenv=(env TORPOR_LIBRARY="$PWD/build-gpu/allocator/libtorpor.so" PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1)
      timeout 420 "${pyenv[@]}" python3 -m pytest -v -s -rs -p no:cacheprovider tests/python/test_distributed_gpu.py \
        > "$OUT/distributed-pytest.log" 2>&1 || status=1
      grep -E "^=+ .*(passed|failed|skipped|error).* in .*=+$|^(FAILED|ERROR|SKIPPED) " "$OUT/distributed-pytest.log"
      ;;
    symmetric)
      build-gpu/tools/torpor symmetric-check --backend cuda --ranks 2 --bytes 4G --json "$OUT/symmetric.json" \
        > "$OUT/symmetric.txt" 2>&1 || status=1
      cat "$OUT/symmetric.txt"
      ;;
    symmetric-nccl)
      build-gpu/tools/torpor symmetric-check --backend cuda --ranks 2 --bytes 1G --group nccl --timeout 10 \
        --timeout-check --json "$OUT/symmetric-nccl.json" > "$OUT/symmetric-nccl.txt" 2>&1 || status=1
      cat "$OUT/symmetric-nccl.txt"
      ;;
    tail)
      # Each step is bounded, so a hang cannot eat the machine's time (expected: ~1 min each).
      sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      timeout 180 build-gpu/tests/torpor_fusion_tests --gtest_filter='TailCuda.*' > "$OUT/tail-tests.log" 2>&1 || status=1
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
            --error-exitcode 86 build-gpu/tests/torpor_fusion_tests --gtest_filter='TailCuda.SanitizerSmoke' \
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
      t=build-gpu/tools/torpor
      gpus=$(nvidia-smi -L | wc -l)
      timeout 120 build-gpu/tests/torpor_fusion_tests --gtest_filter='GpuKernels.*' > "$OUT/stress-kernels.log" 2>&1 || status=1
      grep -E "^\[ +(OK|FAILED|SKIPPED) +\]" "$OUT/stress-kernels.log"
      run_stress 1gpu 120 --ranks 1
      if [ "$gpus" -ge 2 ]; then
        run_stress threads 120 --ranks 2
        stress_fused_unfused
      fi
      ranks=$([ "$gpus" -ge 2 ] && echo 2 || echo 1)
      run_stress soak50 300 --ranks "$ranks" --processes --cycles 50 --vocab 32768 --hidden 1024 --layers 4 \
        --head-dim 128 --experts 16 --latent 256 --inter 2048 --shared-inter 2048
      [ "$gpus" -ge 2 ] && stress_negative_control
      timeout 240 "$t" rl-loop --backend cuda --no-progress --ranks "$ranks" --processes --iterations 3 \
        --vocab 32768 --hidden 1024 --layers 4 --head-dim 128 --experts 16 --latent 256 --inter 2048 \
        --shared-inter 2048 --json "$OUT/rl-loop.json" > "$OUT/rl-loop.txt" 2>&1 || status=1
      echo "== torpor rl-loop"; cat "$OUT/rl-loop.txt"
      ;;
    stress-tail)
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        stress_fused_unfused
        stress_negative_control
      else
        echo "SKIP stress-tail: needs two GPUs (device kind nvidia-h200-x2)"
      fi
      ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
