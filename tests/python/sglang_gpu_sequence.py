"""SGLang's memory-occupation sequence with real PyTorch on a GPU (scripts/gpu_run.sh stage
sglang-sequence), restated from its scheduler (release_memory_occupation /
resume_memory_occupation, _export_static_state / _import_static_state, index id 1302466752):
a model with parameters and buffers loaded in region("weights"), a KV cache in region("kv_cache");
pause kv_cache, stash, pause weights; the trainer takes the memory; resume weights, a weight
update (update_weights_from_tensor: copy_ into the parameters), import the stash, resume kv_cache.

    --engine torpor    torpor.tms with torpor.sglang.register_model (the buffers must be bit-exact
                       before the stash import: the stash restores what is already there)
    --engine torpor-tms-policy  torpor.tms without it (the negative control: the buffers come back
                       discarded, only the stash repairs them)
    --engine tms       torch_memory_saver itself (import torch_memory_saver from PYTHONPATH), the
                       figures beside torpor's in the same run

Writes --json: per cycle the pause/resume seconds, device memory freed, whether the buffers were
exact before the stash, whether the update and the stash left the model right. Exits 1 when the
engine's expectation fails (torpor: exact; control: not exact), 77 without a GPU.
"""

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["torpor", "torpor-tms-policy", "tms"], required=True)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--weights-mib", type=int, default=2048)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if not 1 <= args.cycles <= 100 or not 1 <= args.weights_mib <= 65536:
        ap.error("--cycles must be 1..100 and --weights-mib 1..65536")
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no GPU")
        return 77
    if args.engine == "tms":
        from torch_memory_saver import torch_memory_saver as saver

        saver.hook_mode = "torch"
    else:
        from torpor import sglang as torpor_sglang
        from torpor.tms import torch_memory_saver as saver

    n = args.weights_mib * (1 << 20) // 4 // 4

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, n // 1024, bias=False) for _ in range(4))
            self.register_buffer("cos_sin_cache", torch.randn(4096, 128))
            self.register_buffer("step", torch.arange(1 << 16, dtype=torch.int64))

    with saver.region(tag="weights"):
        model = Model().cuda()
    with saver.region(tag="kv_cache"):
        kv = torch.empty(args.weights_mib << 18, dtype=torch.float32, device="cuda")
    kv.fill_(1.0)
    if args.engine == "torpor":
        torpor_sglang.register_model(model, saver)
    buffers_at_load = {name: b.detach().clone() for name, b in model.named_buffers()}
    cycles = []
    ok = True
    for cycle in range(args.cycles):
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        saver.pause("kv_cache")
        stash = [(name, b.detach().clone()) for name, b in model.named_buffers()]  # _export_static_state
        saver.pause("weights")
        torch.cuda.synchronize()
        pause_s = time.perf_counter() - t0
        free_paused, _ = torch.cuda.mem_get_info()
        trainer = torch.empty(max(1, (free_paused - free_before) // 2), dtype=torch.uint8, device="cuda")
        del trainer
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        saver.resume("weights")
        torch.cuda.synchronize()
        resume_s = time.perf_counter() - t0
        exact = all(torch.equal(b, buffers_at_load[name]) for name, b in model.named_buffers())
        with torch.no_grad():  # update_weights_from_tensor
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.full_like(p, 0.5 + cycle + i))
        named = dict(model.named_buffers())
        for name, tensor in stash:  # _import_static_state
            named[name][...] = tensor
        saver.resume("kv_cache")
        torch.cuda.synchronize()
        updated = all(bool((p == 0.5 + cycle + i).all()) for i, p in enumerate(model.parameters()))
        repaired = all(torch.equal(b, buffers_at_load[name]) for name, b in model.named_buffers())
        expected_exact = args.engine == "torpor"
        cycle_ok = updated and (exact == expected_exact if args.engine != "tms" else repaired)
        ok = ok and cycle_ok
        cycles.append(
            dict(
                cycle=cycle,
                pause_s=pause_s,
                resume_s=resume_s,
                freed_bytes=free_paused - free_before,
                buffers_exact_before_stash=exact,
                weights_updated=updated,
                buffers_right_after_stash=repaired,
                ok=cycle_ok,
            )
        )
        print(json.dumps(cycles[-1]))
    record = dict(
        engine=args.engine,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        weights_mib=args.weights_mib,
        cycles=cycles,
        ok=ok,
    )
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    print(("PASS" if ok else "FAIL") + f": {args.engine}, {args.cycles} cycles")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
