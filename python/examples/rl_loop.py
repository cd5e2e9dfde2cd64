#!/usr/bin/env python3
"""The RL weight-update loop on torpor: an inference engine sleeps while a trainer uses the GPU.

For N iterations:
  sleep(2)                 the engine's memory goes back; parameters and KV cache discarded,
                           state (buffers computed at load) offloaded
  train                    a trainer takes >= 90% of the returned memory, outside torpor, works
                           in it, and produces new weights: a seeded update of the old ones
  free                     the trainer's memory goes back
  wake_up(["weights"])     same addresses, buffers restored
  load                     the new weights are copied into the engine's parameters
  wake_up(["kv_cache"])
  generate                 greedy decoding with the engine
  verify                   a model built fresh with the same new weights must produce the
                           same tokens, token for token

Prints the time of every phase and exits non-zero on any mismatch, or when sleep returned
less than 99.9% of the pools' mapped memory.

    TORPOR_LIBRARY=build-gpu/allocator/libtorpor.so PYTHONPATH=python \\
        python3 python/examples/rl_loop.py --iterations 3 [--json out.json]

Exits 77 (skipped), saying why, without PyTorch or a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

SKIP = 77


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kv-fraction",
        type=float,
        default=0.5,
        help="KV-cache pool size, as a fraction of the free device memory at start",
    )
    ap.add_argument(
        "--train-fraction",
        type=float,
        default=0.92,
        help="the trainer's allocation, as a fraction of the memory sleep returned (>= 0.9)",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05, help="scale of the seeded weight update")
    ap.add_argument("--json", type=pathlib.Path, help="write the measurements here")
    args = ap.parse_args(argv)
    if args.train_fraction < 0.9:
        ap.error("--train-fraction must be >= 0.9 (the trainer takes at least 90% of the returned memory)")
    return args


class Phases:
    """Wall time per phase (device work included: each phase ends with a synchronize)."""

    def __init__(self, torch):
        self.torch, self.seconds = torch, {}

    @contextlib.contextmanager
    def __call__(self, name):
        self.torch.cuda.synchronize()
        t = time.perf_counter()
        yield
        self.torch.cuda.synchronize()
        self.seconds[name] = time.perf_counter() - t


def train(torch, weights: dict, nbytes: int, seed: int, lr: float) -> dict:
    """The trainer: holds `nbytes` of device memory outside torpor, works in all of it, and
    returns new weights (old + lr * seeded noise), on the host."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    buf.fill_(1)  # touch every byte
    n = min(4096, int((nbytes // 12) ** 0.5))  # three n x n fp32 matrices fit
    mats = buf[: 3 * n * n * 4].view(torch.float32).view(3, n, n)
    mats[0].normal_()
    mats[1].normal_()
    torch.matmul(mats[0], mats[1], out=mats[2])  # and do work in it
    checksum = float(buf[-(1 << 20) :].sum()) + float(mats[2].abs().mean())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    new = {}
    for name, w in weights.items():
        w = w.to("cuda")
        new[name] = (w + lr * torch.randn(w.shape, generator=gen, device="cuda")).cpu()
    del buf, mats
    if checksum != checksum:  # NaN: the trainer's memory was not usable
        raise RuntimeError("training phase produced NaN")
    return new


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"rl_loop: skipped: PyTorch is not installed ({e})")
        return SKIP
    if not torch.cuda.is_available():
        print("rl_loop: skipped: PyTorch sees no CUDA device")
        return SKIP
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import torpor
    from tiny_lm import Config, TinyLM, generate, make_kv_cache

    torpor.configure(backend="cuda", fill_on_wake="poison")  # a forgotten reload shows as NaN
    cfg = Config(max_seq=args.prompt_len + args.new_tokens)
    torch.manual_seed(args.seed)
    with torpor.use_pool(torpor.tags.WEIGHTS):
        engine = TinyLM(cfg, device="cuda").eval()
    reg = torpor.register_parameters(engine)
    kv_bytes = int(torch.cuda.mem_get_info()[0] * args.kv_fraction) // (2 << 20) * (2 << 20)
    with torpor.use_pool(torpor.tags.KV_CACHE):
        kv_pool = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    cache = make_kv_cache(cfg, args.batch, kv_pool)
    prompts = torch.randint(
        0, cfg.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(args.seed + 1)
    ).cuda()
    weights = {n: p.detach().cpu() for n, p in engine.named_parameters()}
    print(f"rl_loop: {torch.cuda.get_device_name()}, libtorpor {torpor.library_path()}")
    print(
        f"engine: {reg.parameters} parameters ({reg.nbytes} bytes), KV-cache pool {kv_bytes / 2**30:.1f} GiB, "
        f"batch {args.batch}, {args.new_tokens} new tokens"
    )

    names = ["sleep", "train", "free", "wake_weights", "load", "wake_kv_cache", "generate", "verify"]
    print("iter " + " ".join(f"{n:>13}" for n in names) + "   returned GiB  train GiB  tokens")
    results, ok = [], True
    previous = None
    for it in range(args.iterations):
        phase = Phases(torch)
        torch.cuda.empty_cache()
        mapped = sum(s["mapped_bytes"] for s in torpor.stats().values())
        free_before = torch.cuda.mem_get_info()[0]
        with phase("sleep"):
            torpor.sleep(2)
        returned = torch.cuda.mem_get_info()[0] - free_before
        train_bytes = int(returned * args.train_fraction)
        with phase("train"):
            weights = train(torch, weights, train_bytes, seed=args.seed * 1000 + it, lr=args.lr)
        with phase("free"):
            torch.cuda.empty_cache()
        with phase("wake_weights"):
            torpor.wake_up([torpor.tags.WEIGHTS])
        with phase("load"), torch.no_grad():
            for n, p in engine.named_parameters():
                p.copy_(weights[n])
        with phase("wake_kv_cache"):
            torpor.wake_up([torpor.tags.KV_CACHE])
        with phase("generate"):
            tokens = generate(engine, prompts, args.new_tokens, cache)
        with phase("verify"):
            fresh = TinyLM(cfg, device="cuda").eval()  # PyTorch's own allocator
            with torch.no_grad():
                for n, p in fresh.named_parameters():
                    p.copy_(weights[n])
            reference = generate(fresh, prompts, args.new_tokens, make_kv_cache(cfg, args.batch))
            del fresh
            torch.cuda.empty_cache()
        same = torch.equal(tokens, reference)
        changed = previous is None or not torch.equal(tokens, previous)
        previous = tokens
        iteration_ok = same and returned >= 0.999 * mapped and train_bytes >= 0.9 * returned
        ok &= iteration_ok
        verdict = "equal" if same else f"DIFFER in {int((tokens != reference).sum())} tokens"
        print(
            f"{it:>4} "
            + " ".join(f"{phase.seconds[n] * 1e3:>10.1f} ms" for n in names)
            + f"   {returned / 2**30:>12.2f}  {train_bytes / 2**30:>9.2f}  {verdict}"
            + ("" if changed else " (same as the previous iteration)")
        )
        if returned < 0.999 * mapped:
            print(f"     sleep returned {returned} bytes, less than 99.9% of the {mapped} bytes mapped")
        results.append(
            {
                "iteration": it,
                "seconds": phase.seconds,
                "mapped_bytes": mapped,
                "returned_bytes": returned,
                "train_bytes": train_bytes,
                "tokens_equal": same,
                "tokens_changed_since_previous": changed,
                "ok": iteration_ok,
            }
        )
    print("rl_loop: " + ("PASS: every iteration matched a freshly built model" if ok else "FAIL"))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "iterations": results,
                    "ok": ok,
                },
                indent=2,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
