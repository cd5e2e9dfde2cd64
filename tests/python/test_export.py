"""Exportable pools for KV transports in Python: Pool.export_handles (torpor.exports), and the
PyTorch embedding's use_pool(..., exportable=True) and torpor.export_handles. Oracles outside the
code under test: another process maps each descriptor with mmap (no torpor there) and reports the
bytes it reads, or writes bytes that the owner then reads at the pool's address; the process's
open descriptors (/proc/self/fd); the bytes written before a sleep. The PyTorch cases run in child
processes, since the torch pools' options are fixed once per process (fake_torch, host backend)."""

import gc
import os
import subprocess
import sys
import textwrap

import pytest

import torpor
from conftest import REPO, pattern, subprocess_env

MiB = 1 << 20

# In another process: mmap the inherited descriptor, print the hex of [offset, offset + n), then
# write `new` (hex, may be empty) there.
MAPPER = """
import mmap, sys
fd, size, offset, n, new = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
    print(m[offset:offset + n].hex())
    if new:
        data = bytes.fromhex(new)
        m[offset:offset + len(data)] = data
"""


def read_elsewhere(chunk, address: int, n: int, write: bytes = b"") -> bytes:
    fd = chunk.fd
    out = subprocess.run(
        [sys.executable, "-c", MAPPER, str(fd), str(chunk.nbytes), str(address - chunk.va), str(n), write.hex()],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return bytes.fromhex(out.stdout.strip())


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def holding(chunks, address):
    (chunk,) = [c for c in chunks if c.va <= address < c.va + c.nbytes]
    return chunk


@pytest.fixture
def xpool():
    with torpor.Pool(0, backend="host", va_bytes=1 << 30, fill_on_wake="poison", exportable=True) as p:
        yield p


def test_each_chunk_is_handed_out_once_and_another_process_reads_and_writes_its_bytes(xpool):
    assert xpool.exportable
    kv = xpool.alloc(8 * MiB, "kv_cache", "state", "kv")
    small = xpool.alloc(4096, "kv_cache", "cache", "small")
    w = xpool.alloc(MiB, "weights", "state", "w")
    data = pattern(8 * MiB, 3)
    xpool.write(kv, data)
    with xpool.export_handles("kv_cache", kind="posix_fd") as chunks:
        assert [c.va for c in chunks] == sorted(c.va for c in chunks)
        assert {c.tag for c in chunks} == {"kv_cache"} and {c.kind for c in chunks} == {"posix_fd"}
        assert all(c.gpu_direct_rdma and c.fabric_handle is None for c in chunks)
        assert not any(c.va <= w < c.va + c.nbytes for c in chunks), "another tag's chunk is not handed out"
        assert holding(chunks, small) is not None
        chunk = holding(chunks, kv)
        theirs = pattern(4096, 9)
        assert read_elsewhere(chunk, kv, len(data), write=theirs) == data, "the owner's bytes, in another process"
    assert xpool.read(kv, 4096) == theirs, "what the other process wrote is at the pool's address"
    for p in (kv, small, w):
        xpool.free(p)


def test_the_descriptors_are_owned_closed_with_their_object_and_can_be_detached(xpool):
    kv = xpool.alloc(MiB, "kv_cache", "cache")
    before = open_descriptors()
    chunks = xpool.export_handles(kind="posix_fd")
    assert open_descriptors() == before + len(chunks) == before + 1
    (chunk,) = chunks
    chunks.close()
    assert open_descriptors() == before and chunk.closed
    with pytest.raises(torpor.InvalidState, match="closed or detached; export again"):
        chunk.fd
    with xpool.export_handles(kind="posix_fd") as chunks:
        fd = chunks[0].detach_fd()
    assert open_descriptors() == before + 1, "a detached descriptor is the caller's"
    os.close(fd)
    chunks = xpool.export_handles(kind="posix_fd")
    del chunks
    gc.collect()
    assert open_descriptors() == before, "a collected ExportedChunk closes its descriptor"
    xpool.free(kv)


def test_after_sleep_and_wake_the_tag_hooks_export_new_handles_that_reach_the_restored_bytes(xpool):
    kv = xpool.alloc(4 * MiB, "kv_cache", "state", "kv")
    data = pattern(4 * MiB, 5)
    xpool.write(kv, data)
    transport = {"chunks": xpool.export_handles("kv_cache", kind="posix_fd"), "events": []}
    old = os.dup(holding(transport["chunks"], kv).fd)  # the oracle keeps a view of the old memory
    va = holding(transport["chunks"], kv).va

    def before_unmap(tag):
        transport["chunks"].close()
        transport["events"].append("deregister " + tag)

    def after_map(tag):
        if all(c.closed for c in transport["chunks"]):
            transport["chunks"] = xpool.export_handles(tag, kind="posix_fd")
            transport["events"].append("register " + tag)

    hook = xpool.add_tag_hooks("kv_cache", before_unmap, after_map)
    xpool.sleep(1, "kv_cache")
    with pytest.raises(torpor.InvalidState, match="asleep.*Wake the tag first"):
        xpool.export_handles("kv_cache")
    xpool.wake_up("kv_cache")
    assert transport["events"] == ["deregister kv_cache", "register kv_cache"]
    chunk = holding(transport["chunks"], kv)
    assert chunk.va == va, "the same address after the wake"
    assert read_elsewhere(chunk, kv, len(data)) == data, "the new handle reaches the restored bytes"
    after = pattern(4 * MiB, 6)
    xpool.write(kv, after)
    assert read_elsewhere(chunk, kv, 4096) == after[:4096], "and is the memory mapped now"
    with os.fdopen(old, "rb", buffering=0) as f:
        f.seek(kv - va)
        assert f.read(4096) == data[:4096], "the old handle still names the old memory, not the new"
    xpool.remove_tag_hooks(hook)
    transport["chunks"].close()
    xpool.free(kv)


def test_refusals_name_the_cause_and_the_fix(pool, xpool):
    p = pool.alloc(4096, "kv_cache", "cache")
    assert not pool.exportable
    with pytest.raises(torpor.InvalidState, match=r"not exportable.*torpor\.Pool\(\.\.\., exportable=True\)"):
        pool.export_handles()
    pool.free(p)
    kv = xpool.alloc(4096, "kv_cache", "cache")
    with pytest.raises(torpor.InvalidArgument, match="unknown handle kind 'descriptor'"):
        xpool.export_handles(kind="descriptor")
    with pytest.raises(torpor.InvalidArgument, match="unknown tag 'kv'"):
        xpool.export_handles("kv")
    with pytest.raises(torpor.InvalidType):
        xpool.export_handles(7)
    assert xpool.export_handles([]) == [], "no tag asked for: nothing"
    with pytest.raises(torpor.InvalidType):
        torpor.Pool(0, backend="host", va_bytes=1 << 30, exportable="yes")
    xpool.free(kv)


def test_fabric_handles_are_bytes_and_are_refused_with_the_cause_where_the_device_has_none():
    code = textwrap.dedent(
        """
        import torpor
        with torpor.Pool(0, backend="host", va_bytes=1 << 30, exportable=True) as p:
            kv = p.alloc(4096, "kv_cache", "cache")
            kinds = [c.kind for c in p.export_handles()]
            try:
                p.export_handles(kind="fabric")
                print("fabric", kinds)
            except torpor.Unavailable as e:
                print("refused", kinds, e)
            else:
                (c,) = p.export_handles(kind="fabric")
                print(len(c.fabric_handle), c.fd)
            p.free(kv)
        """
    )

    def run(**env):
        out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(**env), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert run(TORPOR_HOST_FABRIC="on").splitlines() == ["fabric ['fabric']", "64 None"]
    refused = run(TORPOR_HOST_FABRIC="off")
    assert refused.startswith("refused ['posix_fd']"), refused
    assert "no fabric handle support" in refused and "POSIX descriptors" in refused


# --- the PyTorch embedding, on fake_torch ----------------------------------------------------

PRELUDE = f"""
import sys
sys.path.insert(0, {str(REPO / "tests" / "python")!r})
import fake_torch
sys.modules["torch"] = fake_torch
import torpor
from conftest import pattern
from test_export import read_elsewhere, holding
"""


def run_torch(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=subprocess_env(TORPOR_LOG="error"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_use_pool_exportable_creates_the_torch_pool_exportable_and_its_tensors_export_and_re_export():
    out = run_torch(
        """
        from torpor import engine
        torpor.configure(backend="host", fill_on_wake="poison", va_bytes=1 << 30)
        with torpor.use_pool("kv_cache", exportable=True):
            kv = fake_torch.empty(4 << 20)
        with torpor.use_pool("weights"):  # the device's pool is one: exportable too
            w = fake_torch.empty(1 << 20)
        pool = torpor.Pool.torch(0)
        print("exportable", pool.exportable)
        data = pattern(kv._nbytes, 1)
        pool.write(kv.data_ptr(), data)
        chunks = {"kv": torpor.export_handles("kv_cache", kind="posix_fd")}
        chunk = holding(chunks["kv"], kv.data_ptr())
        print("kv read elsewhere", read_elsewhere(chunk, kv.data_ptr(), len(data)) == data)
        print("weights exported", len(torpor.export_handles("weights")))

        def before_unmap(tag):
            chunks["kv"].close()

        def after_map(tag):
            if all(c.closed for c in chunks["kv"]):
                chunks["kv"] = engine.export_handles(tag, kind="posix_fd")
                print("re-exported", tag)

        engine.hooks.add_mapping_hooks("kv_cache", before_unmap, after_map)
        torpor.sleep(1)  # the KV cache is class cache: discarded
        torpor.wake_up()
        after = pattern(kv._nbytes, 2)
        pool.write(kv.data_ptr(), after)
        chunk = holding(chunks["kv"], kv.data_ptr())
        print("after wake read elsewhere", read_elsewhere(chunk, kv.data_ptr(), len(after)) == after)
        """
    )
    assert out.splitlines() == [
        "exportable True",
        "kv read elsewhere True",
        "weights exported 1",
        "re-exported kv_cache",
        "after wake read elsewhere True",
    ], out


def test_use_pool_exportable_after_the_pool_exists_without_is_refused_naming_the_fix():
    out = run_torch(
        """
        torpor.configure(backend="host", va_bytes=1 << 30)
        with torpor.use_pool("weights"):
            w = fake_torch.empty(1 << 20)
        try:
            with torpor.use_pool("kv_cache", exportable=True):
                print("entered")
        except torpor.InvalidState as e:
            print("refused:", e)
        try:
            torpor.export_handles("weights")
        except torpor.InvalidState as e:
            print("export refused:", e)
        """
    )
    assert "entered" not in out
    assert "refused: use_pool(..., exportable=True): the torpor pool of device 0" in out
    assert "torpor.configure(exportable=True)" in out, out
    assert "export refused: torpor_export_handles: export_handles: the pool of device 0 is not exportable" in out, out
