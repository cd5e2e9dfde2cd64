"""One rank of test_distributed_gpu.py: a real torch.distributed group (gloo or nccl), a torpor
pool on this rank's GPU, collective sleep / wake through torpor.distributed over that group.
Prints one JSON line; exits 0 when every check held.

    RANK=r WORLD_SIZE=2 python3 distributed_gpu_worker.py BACKEND INIT_FILE
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import torpor
from torpor import distributed as tdist

MiB = 1 << 20


def main() -> int:
    backend, init_file = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = tdist.Group.from_torch()
    pool = torpor.Pool(rank, backend="cuda", fill_on_wake="poison")
    n = 64 * MiB
    data = bytes((i * 31 + rank * 7 + 3) % 251 for i in range(MiB)) * 64
    ptr = pool.alloc(n, "kv_cache", "state", "kv")
    pool.write(ptr, data)
    out = {"rank": rank, "backend": backend}
    tdist.sleep(pool, 1, group=group)
    out["asleep"] = pool.stats()["mapped_bytes"] == 0
    try:
        tdist.sleep(pool, 1 if rank == 0 else 2, group=group)
        out["mismatch_rejected"] = False
    except torpor.InvalidArgument as e:
        out["mismatch_rejected"] = "rank(s) [1]" in str(e)
    tdist.wake_up(pool, group=group)
    out["bit_exact"] = pool.read(ptr, n) == data
    dist.barrier()
    group.close()
    pool.close()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0 if out["asleep"] and out["mismatch_rejected"] and out["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
