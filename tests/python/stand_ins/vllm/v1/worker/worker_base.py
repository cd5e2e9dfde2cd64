"""vllm.v1.worker.worker_base: a worker process loads the general plugins, then imports its
worker class by qualified name (parallel_config.worker_cls) and builds it."""

import importlib


def resolve_obj_by_qualname(qualname):
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)


class WorkerWrapperBase:
    def __init__(self, rpc_rank=0):
        self.rpc_rank = rpc_rank
        self.worker = None

    def init_worker(self, all_kwargs):
        kwargs = all_kwargs[self.rpc_rank]
        vllm_config = kwargs.get("vllm_config")
        assert vllm_config is not None, "vllm_config is required to initialize the worker"
        self.vllm_config = vllm_config

        from vllm.plugins import load_general_plugins

        load_general_plugins()
        worker_class = resolve_obj_by_qualname(vllm_config.parallel_config.worker_cls)
        self.worker = worker_class(**kwargs)
