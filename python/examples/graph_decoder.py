#!/usr/bin/env python3
"""A Hugging Face-style decoder whose CUDA graph sleeps with the rest of the engine (torpor).

The model is a Llama-architecture causal LM written with plain PyTorch modules (the names of
transformers' modeling_llama: embed_tokens, layers.N.self_attn.{q,k,v,o}_proj, mlp.{gate,up,
down}_proj, input_layernorm, post_attention_layernorm, norm, lm_head; grouped-query attention,
rotary embeddings, SwiGLU, RMSNorm), random weights from a config and a seed (nothing is
downloaded). A static KV cache and a decode step captured once as a CUDA graph, as vLLM and
SGLang run decode:

  weights      torpor.use_pool("weights"), parameters registered (level 2 discards them; the
               rotary inv_freq buffer, computed at construction, is state and comes back)
  KV cache     torpor.use_pool("kv_cache"), with the decode step's static inputs (class cache:
               rewritten before every replay)
  decode graph torpor.graph(graph): its private pool is torpor's, tag "cuda_graph", class cache

then: generate (prefill eagerly, decode by replaying the graph) -> sleep(2) -> wake "weights",
reload the weights from the host checkpoint -> wake the rest -> generate again, replaying the
same graph object (no re-capture): the greedy tokens must be identical.

Device memory is reported awake, asleep and after wake, split as: cudaMemGetInfo's used bytes =
the CUDA context (measured before anything is allocated) + torpor's mapped bytes (its pools,
the graph pool apart) + PyTorch's own pools (torch.cuda.memory_stats' reserved bytes less
torpor's segments; a graph captured outside torpor shows there) + CUDA's graph allocator
(memory nodes) + other (cuBLAS and kernel images, whatever is left).

    --graphs torpor    (default) the decode graph's memory in torpor: released while asleep
    --graphs outside   the same run with the graph captured by torch.cuda.graph into PyTorch's
                       own private pool: it stays resident while asleep (the comparison)

    TORPOR_LIBRARY=build-gpu/allocator/libtorpor.so PYTHONPATH=python \\
        python3 python/examples/graph_decoder.py [--graphs outside] [--json out.json]

Exits 1 when the tokens differ or the graph was captured again, 77 (skipped) without PyTorch or
a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from dataclasses import asdict, dataclass

SKIP = 77

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # the module still imports for --help; main() skips
    torch = None
    nn = type("nn", (), {"Module": object})


@dataclass(frozen=True)
class DecoderConfig:
    """The fields of transformers' LlamaConfig that the architecture needs."""

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin of the positions from inv_freq, a buffer computed here and in no checkpoint."""

    def __init__(self, cfg: DecoderConfig, device):
        super().__init__()
        d = cfg.head_dim
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions, dtype):
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q, k, cos, sin):
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, d]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, dtype, device):
        super().__init__()
        self.cfg = cfg
        h, d, kv = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False, dtype=dtype, device=device)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False, dtype=dtype, device=device)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False, dtype=dtype, device=device)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x, cos, sin, k_cache, v_cache, positions):
        """x [B, T, hidden]; positions [B, T] (int64, on the device): each token's slot in the
        static cache k_cache / v_cache [B, kv_heads, max_pos, d]."""
        cfg = self.cfg
        B, T, _ = x.shape
        h, d, kv = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
        q = self.q_proj(x).view(B, T, h, d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, kv, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, kv, d).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        # Write this step's keys and values at their positions: index_copy_ with a device index
        # tensor, so one captured step serves every position.
        slots = positions[0]
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        # Attend over the whole static cache, masking what is not written yet. Masked values are
        # zeroed too: an unwritten slot holds whatever the memory held (after a sleep, discarded
        # bytes), and softmax's 0 times NaN would still be NaN.
        S = k_cache.shape[2]
        visible = torch.arange(S, device=x.device)[None, :] <= positions[0][:, None]  # [T, S]
        keys = k_cache.repeat_interleave(h // kv, dim=1)
        values = v_cache.masked_fill(~visible[-1][None, None, :, None], 0).repeat_interleave(h // kv, dim=1)
        scores = (q @ keys.transpose(-1, -2)).float() / math.sqrt(d)
        scores = scores.masked_fill(~visible[None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = (probs @ values).transpose(1, 2).reshape(B, T, h * d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, dtype, device):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, dtype, device):
        super().__init__()
        self.self_attn = Attention(cfg, dtype, device)
        self.mlp = MLP(cfg, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, cos, sin, k_cache, v_cache, positions):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, dtype, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg, device)


class DecoderForCausalLM(nn.Module):
    """LlamaForCausalLM's layout; forward(input_ids, positions, cache) -> logits (fp32)."""

    def __init__(self, cfg: DecoderConfig, dtype=None, device="cuda"):
        super().__init__()
        dtype = dtype or torch.bfloat16
        self.cfg = cfg
        self.model = DecoderModel(cfg, dtype, device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)

    def init_weights(self, seed: int) -> None:
        """Random weights from the seed (transformers' normal(0, initializer_range) init)."""
        gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, self.cfg.initializer_range, generator=gen)

    def forward(self, input_ids, positions, cache):
        m = self.model
        x = m.embed_tokens(input_ids)
        cos, sin = m.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(m.layers):
            x = layer(x, cos, sin, cache.keys[i], cache.values[i], positions)
        return self.lm_head(m.norm(x)).float()


class StaticKVCache:
    """[layers] x (keys, values) of [batch, kv_heads, max_positions, head_dim], allocated once."""

    def __init__(self, cfg: DecoderConfig, batch: int, dtype=None, device="cuda"):
        dtype = dtype or torch.bfloat16
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class DecodeStep:
    """One decode step for a fixed batch, captured once as a CUDA graph. Static inputs (token ids,
    positions) are allocated where the caller says (here: the KV-cache pool); replay() writes
    them, replays the graph and returns the next tokens."""

    def __init__(self, model: DecoderForCausalLM, cache: StaticKVCache, batch: int, device="cuda"):
        self.model, self.cache = model, cache
        self.input_ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.graph = None
        self.captures = 0
        self.replays = 0
        self.next_tokens = None

    def _step(self):
        logits = self.model(self.input_ids, self.positions, self.cache)
        return logits[:, -1].argmax(-1)

    @ torch.no_grad() if torch is not None else (lambda f: f)
    def capture(self, graph_context) -> None:
        """Warm up on a side stream (lazy library initialisation outside the capture, as
        PyTorch's documentation does), then capture under graph_context(graph)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with graph_context(self.graph):
            self.next_tokens = self._step()
        self.captures += 1

    def __call__(self, tokens, position: int):
        self.input_ids.copy_(tokens[:, None])
        self.positions.fill_(position)
        self.graph.replay()
        self.replays += 1
        return self.next_tokens.clone()


@ torch.no_grad() if torch is not None else (lambda f: f)
def generate(model: DecoderForCausalLM, cache: StaticKVCache, step: DecodeStep, prompt, new_tokens: int):
    """Greedy: prefill eagerly, then new_tokens - 1 decode steps replaying the graph. [B, new]."""
    B, P = prompt.shape
    if P + new_tokens > model.cfg.max_position_embeddings:
        raise ValueError(f"prompt {P} + {new_tokens} new tokens exceed max_position_embeddings")
    positions = torch.arange(P, device=prompt.device)[None, :].expand(B, P)
    token = model(prompt, positions, cache)[:, -1].argmax(-1)
    out = [token]
    for i in range(new_tokens - 1):
        token = step(token, P + i)
        out.append(token)
    return torch.stack(out, dim=1)


# -- the run -----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", choices=("torpor", "outside"), default="torpor")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=DecoderConfig.num_hidden_layers)
    ap.add_argument("--hidden", type=int, default=DecoderConfig.hidden_size)
    ap.add_argument("--vocab", type=int, default=DecoderConfig.vocab_size)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=pathlib.Path, help="write the measurements here")
    return ap.parse_args(argv)


def device_memory(torpor, device: int, context: int, graph=None) -> dict:
    """cudaMemGetInfo's used bytes, split (see the module note)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    stats = torpor.stats().get(device)
    tags = stats["tags"] if stats else {}
    graph_tags = {p.tag for p in torpor.graph_pools() if p.device == device}
    torpor_graphs = sum(t["mapped_bytes"] for name, t in tags.items() if name in graph_tags)
    torpor_pools = (stats["mapped_bytes"] if stats else 0) - torpor_graphs
    pool = torpor.pools().get(device)
    native = 0
    native_graph = 0
    graph_pool = tuple(graph.pool()) if graph is not None else None
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device) != device or (pool is not None and pool.contains(seg["address"])):
            continue  # torpor's segments are counted as torpor's mapped bytes
        native += seg["total_size"]
        if graph_pool is not None and tuple(seg.get("segment_pool_id", ())) == graph_pool:
            native_graph += seg["total_size"]
    graph_allocator = torpor.graph_memory(device)["reserved"]
    other = used - context - torpor_pools - torpor_graphs - native - graph_allocator
    return {
        "used": used,
        "context": context,
        "torpor_pools": torpor_pools,
        "torpor_graphs": torpor_graphs,
        "pytorch_pools": native,
        "pytorch_graph_pool": native_graph,
        "graph_allocator": graph_allocator,
        "other": other,
        "torpor_tags": {name: t["mapped_bytes"] for name, t in tags.items()},
        "pytorch_reserved_total": torch.cuda.memory_stats(device).get("reserved_bytes.all.current", 0),
    }


def mib(n: int) -> str:
    return f"{n / (1 << 20):10.1f} MiB"


def print_memory(rows: dict) -> None:
    keys = [
        ("used", "device memory in use (cudaMemGetInfo)"),
        ("context", "  CUDA context (measured before allocating)"),
        ("torpor_pools", "  torpor pools: weights, KV cache"),
        ("torpor_graphs", "  graphs in torpor (graph pool tags)"),
        ("pytorch_pools", "  PyTorch's own pools (reserved)"),
        ("pytorch_graph_pool", "    of which the graph's private pool"),
        ("graph_allocator", "  CUDA graph allocator (memory nodes)"),
        ("other", "  other (cuBLAS, kernel images, ...)"),
    ]
    names = list(rows)
    print(f"{'':46}" + "".join(f"{n:>16}" for n in names))
    for key, label in keys:
        print(f"{label:46}" + "".join(f"{mib(rows[n][key]):>16}" for n in names))


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch is None:
        print("SKIP: PyTorch is not installed")
        return SKIP
    if not torch.cuda.is_available():
        print("SKIP: PyTorch sees no CUDA device")
        return SKIP
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import torpor

    device = torch.cuda.current_device()
    torch.cuda.init()
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info(device)
    context = total - free0  # the CUDA context (and anything else on the device) before we allocate
    torpor.configure(backend="cuda", fill_on_wake="poison")
    cfg = DecoderConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
    )
    timings = {}
    t = time.perf_counter()
    with torpor.use_pool("weights"):
        model = DecoderForCausalLM(cfg, device="cuda").eval()
    model.init_weights(args.seed)
    registration = torpor.register_parameters(model)
    checkpoint = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}  # the "safetensors"
    with torpor.use_pool("kv_cache"):
        cache = StaticKVCache(cfg, args.batch)
        step = DecodeStep(model, cache, args.batch)
    timings["build_s"] = time.perf_counter() - t
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen).cuda()

    t = time.perf_counter()
    if args.graphs == "torpor":
        step.capture(lambda g: torpor.graph(g))  # tag "cuda_graph", class cache
    else:
        step.capture(lambda g: torch.cuda.graph(g))  # PyTorch's own private pool
    timings["capture_s"] = time.perf_counter() - t
    graph_object = step.graph

    t = time.perf_counter()
    before = generate(model, cache, step, prompt, args.new_tokens)
    torch.cuda.synchronize()
    timings["generate_s"] = time.perf_counter() - t
    memory = {"awake": device_memory(torpor, device, context, step.graph)}

    t = time.perf_counter()
    sleep_report = torpor.sleep(2)
    timings["sleep_s"] = time.perf_counter() - t
    memory["asleep"] = device_memory(torpor, device, context, step.graph)

    t = time.perf_counter()
    torpor.wake_up(["weights"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(checkpoint[n])
    torpor.wake_up()
    timings["wake_and_reload_s"] = time.perf_counter() - t
    memory["woken"] = device_memory(torpor, device, context, step.graph)

    after = generate(model, cache, step, prompt, args.new_tokens)
    torch.cuda.synchronize()
    same = bool(torch.equal(before, after))
    recaptured = step.captures != 1 or step.graph is not graph_object

    asleep = memory["asleep"]
    resident_graph = asleep["torpor_graphs"] + asleep["pytorch_graph_pool"] + asleep["graph_allocator"]
    print(
        f"graph_decoder: {args.graphs} graphs; {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters "
        f"({registration.nbytes / (1 << 20):.0f} MiB), KV cache {cache.nbytes / (1 << 20):.0f} MiB, "
        f"batch {args.batch}, {args.prompt_len} + {args.new_tokens} tokens; device {torch.cuda.get_device_name(device)}"
    )
    print_memory(memory)
    print(
        f"graph memory resident while asleep: {resident_graph / (1 << 20):.1f} MiB "
        f"({'released by sleep' if args.graphs == 'torpor' else 'captured outside torpor'})"
    )
    print(
        f"decode graph: captured {step.captures} time(s), replayed {step.replays} times; greedy tokens after "
        f"sleep(2) + reload + wake: {'IDENTICAL' if same else 'DIFFERENT'}"
    )
    result = {
        "graphs": args.graphs,
        "config": asdict(cfg),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "parameter_bytes": registration.nbytes,
        "kv_cache_bytes": cache.nbytes,
        "memory": memory,
        "graph_memory_resident_asleep": resident_graph,
        "captures": step.captures,
        "replays": step.replays,
        "tokens_identical": same,
        "sleep_report": {str(k): v for k, v in sleep_report.items()},
        "timings": timings,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not same or recaptured:
        print("FAIL: " + ("tokens differ" if not same else "the graph was captured again"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
