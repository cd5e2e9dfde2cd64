"""SGLang over torpor's torch_memory_saver mode: the model's buffers survive a pause of "weights".

SGLang (python/sglang/srt/torch_memory_saver_adapter.py, index id 16712614316) loads the model
inside ``torch_memory_saver.region("weights")`` (no CPU backup) and pauses and resumes the tags
"kv_cache", "weights" and "cuda_graph". torch_memory_saver discards the whole "weights" region at
a pause, so SGLang's scheduler (release_memory_occupation / resume_memory_occupation, index id
1302466752) copies every named buffer of the model to a stash before pausing the weights
(``_export_static_state``: ``buffer.detach().clone()``) and copies it back after resuming them
(``_import_static_state``), around the trainer's weight update (update_weights_from_tensor).

With ``register_model(model)`` after the ModelRunner loaded the model, a pause of "weights"
discards the parameters only (they are reloaded by the update) and keeps every buffer bit-exact at
its address: SGLang's stash then restores what is already there.

    from torpor import sglang as torpor_sglang
    torpor_sglang.patch_model_runner(ModelRunner)   # before SGLang builds its ModelRunner, or:
    torpor_sglang.register_model(model_runner.model)

Opt-in and torch hook mode only (torpor.tms.TorchMemorySaver.keep_buffers says why).
"""

from __future__ import annotations

import functools

from . import engine, tms
from .errors import InvalidArgument

WEIGHTS = "weights"  # SGLang's GPU_MEMORY_TYPE_WEIGHTS


def register_model(model, saver: tms.TorchMemorySaver | None = None, tag: str = WEIGHTS) -> None:
    """Register `model`'s parameters (re-marked at every pause, so a weight update that replaces
    them is followed) and make `saver`'s pauses of `tag` keep everything else."""
    saver = tms.torch_memory_saver if saver is None else saver
    if not isinstance(saver, tms.TorchMemorySaver):
        raise InvalidArgument(f"register_model: saver {type(saver).__name__} is not a torpor.tms.TorchMemorySaver")
    saver.keep_buffers(tag)
    engine.register_parameters(model)


def patch_model_runner(model_runner_class, saver: tms.TorchMemorySaver | None = None, tag: str = WEIGHTS) -> None:
    """Wrap ``model_runner_class.load_model`` so that every model it loads is registered
    (register_model on ``self.model`` after it returns). Idempotent."""
    load = getattr(model_runner_class, "load_model", None)
    if not callable(load):
        raise InvalidArgument(f"patch_model_runner: {model_runner_class!r} has no load_model method")
    if getattr(load, "_torpor_registers", False):
        return

    @functools.wraps(load)
    def load_model(self, *args, **kwargs):
        out = load(self, *args, **kwargs)
        register_model(self.model, saver, tag)
        return out

    load_model._torpor_registers = True
    model_runner_class.load_model = load_model


__all__ = ["WEIGHTS", "patch_model_runner", "register_model"]
