"""vllm.v1.worker.gpu_worker as in the vLLM versions with pluggable sleep-mode backends: the pools
come from get_mem_allocator_instance() (which imports cumem.CuMemAllocator when called), sleep and
wake go through the backend model_config.sleep_mode_backend names (resolved on first use), and a
level-2 sleep stashes the model's buffers in host memory first and restores them after wake."""

from contextlib import nullcontext

from vllm.device_allocator import get_mem_allocator_instance
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class Worker:
    def __init__(self, vllm_config, local_rank=0, rank=0, distributed_init_method=None, is_driver_worker=False):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self._sleep_saved_buffers = {}
        self._sleep_mode_backend = None

    def _get_sleep_mode_backend(self):
        if self._sleep_mode_backend is None:
            from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

            self._sleep_mode_backend = SleepModeBackendFactory.create_backend(self.vllm_config.model_config)
        return self._sleep_mode_backend

    def init_device(self):
        self.model_runner = GPUModelRunner(self.vllm_config, "cuda:0")

    def _maybe_get_memory_pool_context(self, tag):
        if not self.vllm_config.model_config.enable_sleep_mode:
            return nullcontext()
        allocator = get_mem_allocator_instance()
        if tag == "weights":
            assert allocator.get_current_usage() == 0, "CuMem allocator can only be used for one instance per process."
        return allocator.use_memory_pool(tag=tag)

    def load_model(self, *, load_dummy_weights=False):
        with self._maybe_get_memory_pool_context(tag="weights"):
            self.model_runner.load_model()

    def reload_weights(self, version=1):
        self.model_runner.reload_weights(version)

    def initialize_from_config(self, kv_cache_config):
        with self._maybe_get_memory_pool_context(tag="kv_cache"):
            self.model_runner.initialize_kv_cache(kv_cache_config)

    def get_model(self):
        return self.model_runner.get_model()

    def sleep(self, level=1):
        if level == 2:
            model = self.model_runner.model
            self._sleep_saved_buffers = {name: buffer.cpu().clone() for name, buffer in model.named_buffers()}
        self._get_sleep_mode_backend().suspend(level)

    def wake_up(self, tags=None):
        self._get_sleep_mode_backend().resume(tags)
        if len(self._sleep_saved_buffers):
            model = self.model_runner.model
            for name, buffer in model.named_buffers():
                if name in self._sleep_saved_buffers:
                    buffer.data.copy_(self._sleep_saved_buffers[name].data)
            self._sleep_saved_buffers = {}

    def discard(self, tags):
        self._get_sleep_mode_backend().discard(tags)
