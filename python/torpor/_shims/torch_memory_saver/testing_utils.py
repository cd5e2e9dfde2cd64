"""torch_memory_saver.testing_utils as its own tests import it (get_device, empty_cache, is_xpu;
torch_memory_saver/testing_utils.py at fzyzcjy/torch_memory_saver 4a43c97), so that its
test/test_examples.py harness and test/examples/ run unmodified against torpor.tms."""

from .utils import is_xpu


def get_device() -> str:
    return "xpu" if is_xpu() else "cuda"


def empty_cache() -> None:
    import torch

    (torch.xpu if is_xpu() else torch.cuda).empty_cache()


def get_and_print_gpu_memory(message, gpu_id=0):
    """Device memory in use (total - free), printed with `message`."""
    import torch

    free, total = torch.cuda.mem_get_info(gpu_id)
    used = total - free
    print(f"GPU {gpu_id} memory: {used / 1024**3:.2f} GB used ({message})")
    return used
