"""A model runner with a tiny model: two parameters and a buffer computed at load (a rotary table,
in no checkpoint) in the pool the worker opened, and a KV cache. Tensors are fake_torch's, on
torpor's host backend, so their bytes are host memory: the level-2 buffer stash reads and writes
them with ctypes, as vLLM's reads them with .cpu() and copy_()."""

import ctypes

import torch


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
