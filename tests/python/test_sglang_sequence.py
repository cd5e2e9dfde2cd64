"""SGLang's memory-occupation sequence over torpor.tms (fake torch, host backend), restated from
its scheduler (release_memory_occupation / resume_memory_occupation and _export_static_state /
_import_static_state, index id 1302466752) and its TorchMemorySaverAdapter (index id 16712614316):
the model is loaded in region("weights") without a backup, the KV cache in region("kv_cache");
release pauses kv_cache, stashes the buffers, pauses weights, pauses cuda_graph; the trainer runs;
resume wakes cuda_graph and weights, the trainer's update_weights_from_tensor writes new
parameters, the stash is imported, kv_cache wakes.

With torpor.sglang.register_model the buffers are bit-exact *before* the stash is imported (the
stash restores what is there); under torch_memory_saver's policy (no registration) they come back
discarded, which is why SGLang stashes them: that is the negative control. The oracle is the bytes
written at load."""

import pytest

import torpor
from torpor import sglang as torpor_sglang
from conftest import MiB, POISON
from test_tms_mode import read, torch, write  # noqa: F401  (torch: the fake-torch fixture)

# SGLang's tags (GPU_MEMORY_TYPE_WEIGHTS, _KV_CACHE, _CUDA_GRAPH), prefixed: the torch pools are the
# process's, and other test files pause "weights" of their own.
WEIGHTS, KV, GRAPH = "sgl.weights", "sgl.kv_cache", "sgl.cuda_graph"


def load_model(torch, saver):  # noqa: F811 (the fixture)
    """What SGLang's ModelRunner does: the model's tensors inside region("weights")."""
    with saver.region(tag=WEIGHTS):
        w1, w2 = torch.empty(2 * MiB), torch.empty(MiB)
        rope = torch.empty(256 << 10)  # a buffer (cos/sin cache): not a parameter
    return torch.nn.Module(w1=w1, layer=torch.nn.Module(w2=w2)), rope


def sglang_cycle(torch, saver, model, rope):  # noqa: F811 (the fixture)
    """One release + trainer + resume + weight update, SGLang's order. Returns what the buffer
    held right after resume("weights"), before the stash import, and the parameters then."""
    with saver.region(tag=KV):
        kv = torch.empty(4 * MiB)
    write(kv, 9)
    rope_bytes = read(rope)
    # release_memory_occupation(tags=None)
    saver.pause(KV)
    stash = read(rope)  # _export_static_state: named buffers cloned
    saver.pause(WEIGHTS)
    saver.pause(GRAPH)  # no region used it: nothing to do
    trainer = torpor.Pool(0, backend="host", va_bytes=1 << 30)  # the trainer uses the freed memory
    t = trainer.alloc(8 * MiB, "trainer")
    trainer.free(t)
    trainer.close()
    # resume_memory_occupation(tags=["weights"]) then update_weights_from_tensor
    saver.resume(GRAPH)
    saver.resume(WEIGHTS)
    rope_before_stash = read(rope)
    params_before_update = {n: read(p) for n, p in model.named_parameters()}
    new = {n: write(p, 40 + i) for i, (n, p) in enumerate(model.named_parameters())}
    torpor.Pool.torch(0).write(rope.data_ptr(), stash)  # _import_static_state
    saver.resume(KV)
    return rope_bytes, rope_before_stash, params_before_update, new


def test_registered_model_keeps_its_buffers_bit_exact_without_the_stash(torch):  # noqa: F811 (the fixture)
    torch, saver = torch
    model, rope = load_model(torch, saver)
    for i, (_, p) in enumerate(model.named_parameters()):
        write(p, 20 + i)
    write(rope, 30)
    torpor_sglang.register_model(model, saver, tag=WEIGHTS)
    for cycle in range(2):  # twice: the re-mark follows the model across pauses
        rope_bytes, rope_now, params_then, new = sglang_cycle(torch, saver, model, rope)
        assert rope_now == rope_bytes, f"cycle {cycle}: the buffer came back bit-exact before the stash import"
        for name, data in params_then.items():
            assert data == POISON * len(data), f"cycle {cycle}: parameter {name} was discarded, not copied"
        for name, p in model.named_parameters():
            assert read(p) == new[name], "the weight update is what the parameters hold"


def test_control_under_torch_memory_savers_policy_the_buffers_need_the_stash(torch):  # noqa: F811 (the fixture)
    torch, saver = torch
    model, rope = load_model(torch, saver)
    write(rope, 31)
    rope_bytes, rope_now, _, _ = sglang_cycle(torch, saver, model, rope)
    assert rope_now == POISON * len(rope_now), "without register_model the whole weights region is discarded"
    assert read(rope) == rope_bytes, "and only SGLang's stash brings the buffer back"


def test_patch_model_runner_registers_every_model_it_loads(torch):  # noqa: F811 (the fixture)
    torch, saver = torch

    class ModelRunner:
        def load_model(self):
            self.model, self.rope = load_model(torch, saver)
            return "loaded"

    torpor_sglang.patch_model_runner(ModelRunner, saver, tag=WEIGHTS)
    torpor_sglang.patch_model_runner(ModelRunner, saver, tag=WEIGHTS)  # idempotent
    runner = ModelRunner()
    assert runner.load_model() == "loaded"
    write(runner.rope, 32)
    rope_bytes, rope_now, _, _ = sglang_cycle(torch, saver, runner.model, runner.rope)
    assert rope_now == rope_bytes
    with pytest.raises(torpor.InvalidArgument, match="no load_model"):
        torpor_sglang.patch_model_runner(object)
