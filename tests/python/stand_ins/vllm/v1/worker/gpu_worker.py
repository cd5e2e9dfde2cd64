"""vllm.v1.worker.gpu_worker, generations "v1" and "mrv2" (vllm/__init__.py).

"v1" (the V1 worker with pluggable sleep-mode backends; README's vLLM section): the pools come
from get_mem_allocator_instance() (which imports cumem.CuMemAllocator when called), sleep and
wake go through the backend model_config.sleep_mode_backend names (resolved on first use), and a
level-2 sleep stashes the model's buffers in host memory first and restores them after wake.

"mrv2" adds what the newest worker does, read (not copied) from gpu_worker.py as stored in the
code index (index ids 54489122067 and 61161868704: sleep/wake_up through the backend, the buffer
stash, ``post_kv_cache_wake_up`` when ``tags is None or "kv_cache" in tags``; 66814454036, a
walk-through of the same file: the four weight-transfer calls ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``), a KV connector that keeps a
transport registration of the KV cache through ``register_tag_hooks`` (NIXL's use of it), and Model
Runner V2's graph capture into the sleep pool (gpu_model_runner.capture_model). Its pools follow
``model_config.enable_cumem_allocator``, not sleep mode alone (``_maybe_get_memory_pool_context`` of
gpu_worker.py, code index id 66475387063; vllm-project/vllm#33648: the cumem allocator without sleep
mode, for NIXL; sleep mode turns it on in ``ModelConfig.__post_init__``), and a KV connector's
configuration is ``vllm_config.kv_transfer_config.kv_connector``."""

from contextlib import nullcontext

from vllm import GENERATION
from vllm.device_allocator import get_mem_allocator_instance
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class KVConnector:
    """A transport that registered the KV cache's memory (NIXL-like): it must deregister before the
    memory is unmapped and register again once it is mapped; reading the first byte in each hook
    stands for the driver call (it faults on unmapped memory, as the transport's would fail)."""

    def __init__(self, kv):
        import ctypes

        from vllm.device_allocator import register_tag_hooks

        self.kv, self.events, self.registered = kv, [], True
        self._read = lambda: ctypes.string_at(kv.data_ptr(), 1)
        self.unregister = register_tag_hooks("kv_cache", self.before_unmap, self.after_map)

    def before_unmap(self):
        self._read()
        self.events.append("deregister")
        self.registered = False

    def after_map(self):
        self._read()
        if not self.registered:  # idempotent, as vLLM asks of after_map
            self.events.append("register")
            self.registered = True


class Worker:
    def __init__(self, vllm_config, local_rank=0, rank=0, distributed_init_method=None, is_driver_worker=False):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self._sleep_saved_buffers = {}
        self._sleep_mode_backend = None
        self.kv_connector = None
        self.kv_wake_ups = 0
        self._weight_update = None

    def _get_sleep_mode_backend(self):
        if self._sleep_mode_backend is None:
            from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

            self._sleep_mode_backend = SleepModeBackendFactory.create_backend(self.vllm_config.model_config)
        return self._sleep_mode_backend

    def init_device(self):
        self.model_runner = GPUModelRunner(self.vllm_config, "cuda:0")

    def _maybe_get_memory_pool_context(self, tag):
        config = self.vllm_config.model_config
        if not (config.enable_cumem_allocator if GENERATION == "mrv2" else config.enable_sleep_mode):
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
        if GENERATION == "mrv2":
            self.kv_connector = KVConnector(self.model_runner.kv_cache)

    def compile_or_warm_up_model(self):
        if GENERATION == "mrv2":
            self.model_runner.capture_model()

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
        if GENERATION == "mrv2" and (tags is None or "kv_cache" in tags):
            self.kv_wake_ups += 1  # vLLM: model_runner.post_kv_cache_wake_up()

    def discard(self, tags):
        self._get_sleep_mode_backend().discard(tags)

    if GENERATION == "mrv2":

        def init_weight_transfer_engine(self, init_info):
            self._weight_update = {"init": dict(init_info)}

        def start_weight_update(self):
            assert self._weight_update is not None, "init_weight_transfer_engine first"
            self._weight_update["version"] = None

        def update_weights(self, update_info):
            self._weight_update["version"] = update_info["version"]

        def finish_weight_update(self):
            # The layerwise reload's finalize: parameters re-created, in the weights pool.
            allocator = get_mem_allocator_instance()
            with allocator.reuse_memory_pool("weights"):
                self.model_runner.replace_parameters(self._weight_update["version"])
