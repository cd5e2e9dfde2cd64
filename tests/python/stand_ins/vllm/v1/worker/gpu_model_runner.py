"""A model runner with a tiny model: two parameters and a buffer computed at load (a rotary table,
in no checkpoint) in the pool the worker opened, and a KV cache. Tensors are fake_torch's, on
torpor's host backend, so their bytes are host memory: the level-2 buffer stash reads and writes
them with ctypes, as vLLM's reads them with .cpu() and copy_().

Generation "mrv2" (vllm/__init__.py): ``capture_model`` captures one decode step as a CUDA graph
through ``vllm.device_allocator.use_cudagraph_pool(pool, vllm_config)`` (Model Runner V2's route,
index id 71337998459): out = w + kv (bytewise, first GRAPH_BYTES) plus a constant allocated in the
capture; ``decode()`` replays it and returns the "tokens" (out's bytes). ``replace_parameters``
re-creates every parameter tensor with new bytes (the weight-transfer engine's layerwise reload),
keeping the buffers."""

import ctypes

import torch

from vllm import GENERATION

GRAPH_BYTES = 4096


class DeviceTensor:
    """A fake_torch tensor with the few tensor methods the worker's buffer stash uses."""

    def __init__(self, t):
        self.t = t

    @property
    def data(self):
        return self

    def cpu(self):
        return HostTensor(ctypes.string_at(self.t.data_ptr(), self.t._nbytes))

    def copy_(self, src):
        ctypes.memmove(self.t.data_ptr(), src.raw, len(src.raw))
        return self


class HostTensor:
    def __init__(self, raw):
        self.raw = raw

    @property
    def data(self):
        return self

    def clone(self):
        return HostTensor(bytes(self.raw))


class Model(torch.nn.Module):
    def __init__(self, **params):
        super().__init__(**params)
        self.buffers = {}

    def named_buffers(self):
        return iter(self.buffers.items())


def pattern(n, seed):
    return bytes((i * 131 + seed * 17 + 5) % 253 for i in range(n))


def write(t, data):
    ctypes.memmove(t.data_ptr(), data, len(data))


class GPUModelRunner:
    def __init__(self, vllm_config, device):
        self.vllm_config, self.device = vllm_config, device
        self.model = None
        self.kv_cache = None

    def load_model(self, version=1):
        w = torch.empty(96 << 10)
        b = torch.empty(32 << 10)
        rope = torch.empty(16 << 10)
        write(w, pattern(96 << 10, version))
        write(b, pattern(32 << 10, version + 1))
        write(rope, pattern(16 << 10, 99))
        self.model = Model(w=w, b=b)
        self.model.buffers["rope"] = DeviceTensor(rope)

    def reload_weights(self, version=1):
        for i, (name, p) in enumerate(self.model.named_parameters()):
            write(p, pattern(p._nbytes, version + i))

    def initialize_kv_cache(self, kv_cache_config):
        self.kv_cache = torch.empty(256 << 10)
        write(self.kv_cache, pattern(256 << 10, 7))

    def get_model(self):
        return self.model

    def capture_model(self):
        from vllm.device_allocator import is_capturing_into_cumem_pool, use_cudagraph_pool

        assert GENERATION == "mrv2"
        self.graph = torch.cuda.CUDAGraph()
        self.captured_into_cumem = []
        with use_cudagraph_pool(None, self.vllm_config) as pool:
            with torch.cuda.graph(self.graph, pool=pool, stream=torch.cuda.Stream()):
                self.captured_into_cumem.append(is_capturing_into_cumem_pool())
                self.graph_out = torch.empty(GRAPH_BYTES)
                self.graph_const = torch.empty(GRAPH_BYTES)
                w, kv, out, const = self.model._parameters["w"], self.kv_cache, self.graph_out, self.graph_const
                torch.launch(
                    lambda: write(out, step(read(w, GRAPH_BYTES), read(kv, GRAPH_BYTES), read(const, GRAPH_BYTES)))
                )
        write(self.graph_const, pattern(GRAPH_BYTES, 42))

    def decode(self):
        self.graph.replay()
        return read(self.graph_out, GRAPH_BYTES)

    def replace_parameters(self, version):
        old = dict(self.model.named_parameters())
        fresh = {}
        for i, (name, p) in enumerate(old.items()):
            t = torch.empty(p._nbytes)
            write(t, pattern(p._nbytes, version + i))
            fresh[name] = t
        model = Model(**fresh)
        model.buffers = self.model.buffers
        self.model = model
        for p in old.values():
            p.free()


def read(t, n):
    return ctypes.string_at(t.data_ptr(), n)


def step(w, kv, const):
    """The decode step's arithmetic (the oracle the driver recomputes from the inputs)."""
    return bytes((a + b + c) % 256 for a, b, c in zip(w, kv, const))
