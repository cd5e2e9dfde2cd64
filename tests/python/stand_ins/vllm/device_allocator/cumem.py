"""vllm.device_allocator.cumem as it is where vLLM's C extension (vllm.cumem_allocator) is
missing: the class exists, get_instance() refuses. torpor's plugin replaces the class."""

cumem_available = False


class CuMemAllocator:
    instance = None
    default_tag = "default"

    @staticmethod
    def get_instance():
        assert cumem_available, "cumem allocator is not available"
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance
