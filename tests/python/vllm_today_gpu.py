"""GPU record of issue 26 (vLLM as it is today), with real PyTorch on one CUDA device; run by
`scripts/gpu_run.sh vllm-today`, which runs it twice: `--policy torpor` (the record) and
`--policy vllm` (the field cases' negative control, which must lose them).

In one process, through torpor.vllm.CuMemAllocator (the allocator the plugin puts under vLLM's
name), the way Model Runner V2 uses it:

1. a tiny greedy decoder (embedding and projection in "weights", a KV-like tensor in "kv_cache")
   whose decode step is captured as a CUDA graph inside ``use_cudagraph_pool()``;
2. vLLM-style tag hooks (torpor.vllm.register_tag_hooks) on "kv_cache" and "weights", recording
   the order they fire in;
3. sleep(1) (offload "weights"), wake, replay: the same tokens; sleep(2) (offload nothing), wake
   "weights", reload the weights from a host copy, wake "kv_cache", replay without re-capture: the
   same tokens; device memory in use (torch.cuda.mem_get_info) awake and asleep, and the graph
   pool's mapped bytes while asleep (0: released);
4. the field cases of tests/python/test_vllm_current.py on the GPU: FP8 scale parameters matched
   by a preserve glob and an FP8 scale buffer, a LoRA stacked tensor, an EPLB expert map, each
   compared bit-exact after level 2 + reload + wake. `--policy vllm` runs them under vLLM's level-2
   policy of the reported versions (nothing registered, buffers stashed and copied back).

Prints one line per check and writes everything to --json; exits 1 when a check fails.
"""

import argparse
import json
import sys

import torch

import torpor
from torpor.vllm import CuMemAllocator, register_tag_hooks

MiB = 1 << 20


def used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", choices=["torpor", "vllm"], default="torpor")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torpor.configure(backend="cuda", fill_on_wake="poison")
    allocator = CuMemAllocator.get_instance()
    out = {"policy": args.policy, "checks": {}}

    def check(name, ok, detail=""):
        out["checks"][name] = bool(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)

    gen = torch.Generator(device="cuda").manual_seed(26)
    vocab, dim, steps = 4096, 1024, 16
    with allocator.use_memory_pool(tag="weights"):
        embed = torch.randn(vocab, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        proj = torch.randn(dim, vocab, device="cuda", generator=gen, dtype=torch.bfloat16)
        fp8_k_scale = torch.nn.Parameter(torch.rand(dim, device="cuda", generator=gen), requires_grad=False)
        fp8_v_scale = torch.nn.Parameter(torch.rand(dim, device="cuda", generator=gen), requires_grad=False)
        fp8_input_scale = torch.rand(dim, device="cuda", generator=gen)  # a buffer
        lora_a_stacked = torch.randn(8, 16, dim, device="cuda", generator=gen)  # plain tensor
        expert_map = torch.randperm(256, device="cuda", generator=gen).to(torch.int32)  # EPLB table
        extra = torch.nn.Module()
        extra.k_scale, extra.v_scale = fp8_k_scale, fp8_v_scale
        extra.register_buffer("input_scale", fp8_input_scale)
    model = torch.nn.Module()
    model.embed = torch.nn.Parameter(embed, requires_grad=False)
    model.proj = torch.nn.Parameter(proj, requires_grad=False)
    model.attn = extra
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.randn(64 * MiB // 2, device="cuda", generator=gen, dtype=torch.bfloat16)
    host_weights = {"embed": embed.cpu(), "proj": proj.cpu()}  # the checkpoint a reload reads
    field = {
        "attn.k_scale": fp8_k_scale.data,
        "attn.v_scale": fp8_v_scale.data,
        "attn.input_scale": fp8_input_scale,
        "lora_a_stacked": lora_a_stacked,
        "expert_map": expert_map,
    }
    field_expected = {k: v.clone().cpu() for k, v in field.items()}
    if args.policy == "torpor":
        reg = torpor.register_parameters(model, preserve=["attn.k_scale", "attn.v_scale"])
        out["registered_parameters"] = reg.parameters

    events = []
    unhook = [
        register_tag_hooks("kv_cache", lambda: events.append("kv before_unmap"), lambda: events.append("kv after_map")),
        register_tag_hooks("weights", lambda: events.append("w before_unmap"), lambda: events.append("w after_map")),
    ]

    # -- the MRV2-style capture ------------------------------------------------------------
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as PyTorch recommends
        _ = (model.embed[token] * kv[:dim].view(1, dim)) @ model.proj
    torch.cuda.current_stream().wait_stream(stream)
    with allocator.use_cudagraph_pool() as pool:
        with torch.cuda.graph(graph, pool=pool):
            out["current_tag_in_capture"] = allocator.current_tag
            logits = (model.embed[token] * kv[:dim].view(1, dim)) @ model.proj
            next_token = logits.argmax(dim=-1)

    def decode() -> list[int]:
        token.zero_()
        seq = []
        for _ in range(steps):
            graph.replay()
            token.copy_(next_token)
            seq.append(int(next_token.item()))
        return seq

    tokens = decode()
    out["tokens"] = tokens
    out["used_awake"] = used()
    check("captured into the cudagraph tag", out["current_tag_in_capture"] == "cudagraph")

    # -- sleep(1) --------------------------------------------------------------------------
    kv_copy = kv.clone().cpu()  # the engine recomputes its KV cache; the record restores it
    events.clear()
    allocator.sleep(offload_tags=("weights",))
    st = torpor.stats(0)["tags"]
    out["level1"] = {"used_asleep": used(), "graph_mapped_asleep": st["cudagraph"]["mapped_bytes"]}
    allocator.wake_up(None)
    kv.copy_(kv_copy.cuda())
    out["level1"]["hooks"] = list(events)
    check("level 1: graph memory released while asleep", out["level1"]["graph_mapped_asleep"] == 0)
    check("level 1: same tokens, no re-capture", decode() == tokens)
    check(
        "level 1: hooks fire in order",
        events == ["w before_unmap", "kv before_unmap", "kv after_map", "w after_map"],
        str(events),
    )

    # -- sleep(2), reload, wake ------------------------------------------------------------
    stash = {"attn.input_scale": fp8_input_scale.clone().cpu()} if args.policy == "vllm" else {}
    events.clear()
    allocator.sleep(offload_tags=())
    st = torpor.stats(0)["tags"]
    out["level2"] = {
        "used_asleep": used(),
        "graph_mapped_asleep": st["cudagraph"]["mapped_bytes"],
        "weights_offloaded": st["weights"]["offloaded_bytes"],
    }
    allocator.wake_up(["weights"])
    out["level2"]["hooks_after_weights"] = list(events)
    model.embed.data.copy_(host_weights["embed"].cuda())
    model.proj.data.copy_(host_weights["proj"].cuda())
    for name, data in stash.items():  # vLLM's _sleep_saved_buffers
        field[name].copy_(data.cuda())
    allocator.wake_up(["kv_cache"])
    kv.copy_(kv_copy.cuda())
    out["level2"]["hooks"] = list(events)
    check("level 2: graph memory released while asleep", out["level2"]["graph_mapped_asleep"] == 0)
    check("level 2: same tokens after reload, no re-capture", decode() == tokens)
    check(
        "level 2: hooks fire in order",
        events == ["kv before_unmap", "w before_unmap", "w after_map", "kv after_map", "w after_map"],
        str(events),
    )
    torch.cuda.synchronize()
    kept = {k: bool(torch.equal(v.cpu(), field_expected[k])) for k, v in field.items()}
    out["field_cases_kept"] = kept
    if args.policy == "torpor":
        check("field cases bit-exact after level 2 + reload + wake", all(kept.values()), str(kept))
    else:
        lost = [k for k in ("attn.k_scale", "attn.v_scale", "lora_a_stacked", "expert_map") if not kept[k]]
        check("negative control: vLLM's policy loses the field cases", len(lost) == 4, str(kept))
    for u in unhook:
        u()
    print(
        f"device memory in use: awake {out['used_awake'] / MiB:.0f} MiB, level 1 asleep "
        f"{out['level1']['used_asleep'] / MiB:.0f} MiB, level 2 asleep {out['level2']['used_asleep'] / MiB:.0f} MiB"
    )
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(out["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
