set -u
export TORPOR_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for t in new old; do
  src=$([ $t = new ] && echo . || echo .anchors/old)
  cmake -S $src -B /tmp/b-$t -G Ninja -DCMAKE_BUILD_TYPE=Release > $OUT/cfg-$t.log 2>&1 && cmake --build /tmp/b-$t -j16 --target torpor_bench_sleep > $OUT/build-$t.log 2>&1 || { echo "build $t failed"; tail -20 $OUT/build-$t.log; }
done
for round in 1 2; do for t in old new; do
  spill=$(mktemp -d "$PWD/spill.XXXXXX")
  timeout 150 /tmp/b-$t/bench/torpor_bench_sleep --no-baseline --cycles 2 --host-store-limit 16G --spill-dir "$spill" --json $OUT/spill-$t-$round.json > $OUT/spill-$t-$round.txt 2>&1
  echo "== $t round $round (exit $?)"; grep -E "^cycle" $OUT/spill-$t-$round.txt
  rm -rf "$spill"
done; done
