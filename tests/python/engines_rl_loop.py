#!/usr/bin/env python3
"""The RL weight-update loop through torpor's vLLM mode, as vLLM's worker drives it (issue 14):

    with allocator.use_memory_pool("weights"): load the model; torpor.register_parameters(model)
    with allocator.use_memory_pool("kv_cache"): allocate the KV cache
    for each iteration:
        allocator.sleep(offload_tags=())          level 2 (vLLM's worker: no offload tags),
                                                  without vLLM's buffer stash
        (the trainer runs; new weights on the host)
        allocator.wake_up(["weights"]); reload the parameters
        allocator.wake_up(["kv_cache"]); generate; compare with a fresh model of those weights

Per iteration it records the process's RSS, torpor's host store bytes (mapped and in use), the
bytes the sleep copied to host memory per class, and whether the outputs matched; the
parameters' offloaded bytes must be 0 (level 2 copies no weight to host), the buffers must come
back bit-exact without a stash. Writes --json; exits 1 on any failure, 77 (skipped) without
PyTorch or a CUDA device.

    TORPOR_LIBRARY=build-gpu/allocator/libtorpor.so PYTHONPATH=python \\
        python3 tests/python/engines_rl_loop.py --iterations 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

SKIP = 77
REPO = pathlib.Path(__file__).resolve().parents[2]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--kv-bytes", type=int, default=2 << 30)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"engines_rl_loop: skipped: PyTorch is not installed ({e})")
        return SKIP
    if not torch.cuda.is_available():
        print("engines_rl_loop: skipped: PyTorch sees no CUDA device")
        return SKIP
    sys.path.insert(0, str(REPO / "python" / "examples"))
    import torpor
    from torpor.vllm import CuMemAllocator
    from tiny_lm import Config, TinyLM, generate, make_kv_cache

    torpor.configure(backend="cuda", fill_on_wake="poison")  # a forgotten reload shows as NaN
    allocator = CuMemAllocator.get_instance()
    cfg = Config()
    torch.manual_seed(0)
    with allocator.use_memory_pool("weights"):
        engine = TinyLM(cfg, device="cuda").eval()
    torpor.register_parameters(engine)
    with allocator.use_memory_pool("kv_cache"):
        storage = torch.empty(args.kv_bytes, dtype=torch.uint8, device="cuda")
    cache = make_kv_cache(cfg, 4, storage)
    buffers = {n: b.detach().clone() for n, b in engine.named_buffers()}
    prompt = torch.randint(0, cfg.vocab, (4, 16), generator=torch.Generator().manual_seed(1)).cuda()
    weights = {n: p.detach().cpu().clone() for n, p in engine.named_parameters()}

    records, ok = [], True
    for it in range(args.iterations):
        allocator.sleep(offload_tags=())
        st = torpor.stats(0)
        tags = st["tags"]
        asleep = {
            "rss_bytes": rss_bytes(),
            "host_store_bytes": st["host_store_bytes"],
            "host_store_used_bytes": st["host_store_used_bytes"],
            "mapped_bytes": {t: tags[t]["mapped_bytes"] for t in ("weights", "kv_cache")},
            "offloaded_bytes": {
                f"{t}.{c}": tags[t]["classes"][c]["offloaded_bytes"]
                for t in ("weights", "kv_cache")
                for c in tags[t]["classes"]
            },
        }
        # The trainer: new weights, on the host (its device work is rl_loop.py's subject).
        gen = torch.Generator().manual_seed(100 + it)
        weights = {n: w + 0.05 * torch.randn(w.shape, generator=gen) for n, w in weights.items()}
        allocator.wake_up(["weights"])
        with torch.no_grad():
            for n, p in engine.named_parameters():
                p.copy_(weights[n])
        allocator.wake_up(["kv_cache"])
        buffers_exact = all(torch.equal(b, buffers[n]) for n, b in engine.named_buffers())
        tokens = generate(engine, prompt, 16, cache)
        fresh = TinyLM(cfg, device="cuda").eval()
        fresh.load_state_dict({**weights, **{n: b.cpu() for n, b in buffers.items()}}, strict=False)
        expected = generate(fresh, prompt, 16, make_kv_cache(cfg, 4, device="cuda"))
        del fresh
        weights_copied = asleep["offloaded_bytes"].get("weights.parameter", 0)
        record = {
            "iteration": it,
            "asleep": asleep,
            "awake_rss_bytes": rss_bytes(),
            "weights_copied_to_host_bytes": weights_copied,
            "buffers_exact_without_stash": buffers_exact,
            "tokens_match": bool(torch.equal(tokens, expected)),
        }
        good = weights_copied == 0 and buffers_exact and record["tokens_match"]
        ok = ok and good
        records.append(record)
        print(
            f"iteration {it}: rss asleep {asleep['rss_bytes'] >> 20} MiB, host store "
            f"{asleep['host_store_bytes'] >> 20} MiB ({asleep['host_store_used_bytes'] >> 20} MiB used), "
            f"weights copied {weights_copied} B, buffers exact {buffers_exact}, "
            f"tokens match {record['tokens_match']}: {'ok' if good else 'FAILED'}"
        )
    if args.json:
        args.json.write_text(json.dumps({"ok": ok, "iterations": records}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
