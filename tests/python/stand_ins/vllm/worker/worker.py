"""vllm.worker.worker as in the oldest vLLM with sleep mode: CuMemAllocator is imported when this
module loads and called directly; a level-2 sleep stashes the buffers itself."""

from contextlib import nullcontext

from vllm.device_allocator.cumem import CuMemAllocator
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class Worker:
    def __init__(self, vllm_config, local_rank=0, rank=0, distributed_init_method=None, is_driver_worker=False):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self._sleep_saved_buffers = {}

    def init_device(self):
        self.model_runner = GPUModelRunner(self.vllm_config, "cuda:0")

    def load_model(self):
        if self.vllm_config.model_config.enable_sleep_mode:
            allocator = CuMemAllocator.get_instance()
            assert allocator.get_current_usage() == 0, "Sleep mode can only be used for one instance per process."
            context = allocator.use_memory_pool(tag="weights")
        else:
            context = nullcontext()
        with context:
            self.model_runner.load_model()

    def reload_weights(self, version=1):
        self.model_runner.reload_weights(version)

    def initialize_from_config(self, kv_cache_config):
        if self.vllm_config.model_config.enable_sleep_mode:
            context = CuMemAllocator.get_instance().use_memory_pool(tag="kv_cache")
        else:
            context = nullcontext()
        with context:
            self.model_runner.initialize_kv_cache(kv_cache_config)

    def get_model(self):
        return self.model_runner.get_model()

    def sleep(self, level=1):
        if level == 2:
            model = self.model_runner.model
            self._sleep_saved_buffers = {name: buffer.cpu().clone() for name, buffer in model.named_buffers()}
        allocator = CuMemAllocator.get_instance()
        allocator.sleep(offload_tags=("weights",) if level == 1 else tuple())

    def wake_up(self, tags=None):
        allocator = CuMemAllocator.get_instance()
        allocator.wake_up(tags)
        if len(self._sleep_saved_buffers):
            model = self.model_runner.model
            for name, buffer in model.named_buffers():
                if name in self._sleep_saved_buffers:
                    buffer.data.copy_(self._sleep_saved_buffers[name].data)
            self._sleep_saved_buffers = {}
