"""What a TorchMemorySaver's regions share, whatever the hook mode: the tags they created, their
MemPools under torch_memory_saver's keys, the retain_cpu_backup setting, and the host-store
settings their backups ask of torpor's pools (the disk directory, the pageable tier).

torpor's host store is per pool, and fixed before the pool's first allocation: a disk directory
(TMS_DISK_BACKUP_DIR, set_disk_backup_dir, or /tmp for a region with enable_disk_backup) makes the
pools' disk tier hold every backup, a file per allocation as torch_memory_saver writes them
(csrc/disk_backend.cpp at 4a43c97); TMS_INIT_CPU_BACKUP_BACKEND=mmap makes every backup pageable.
``Regions.apply_store`` puts that on the pools, once, or says why it cannot any more.
"""

from __future__ import annotations

import threading
from typing import Optional

from .. import engine, environment
from ..errors import InvalidArgument, InvalidState, Unavailable

TAG_DEFAULT = "default"
CPU_BACKUP_BACKENDS = ("mmap", "pinned")
DISK_DIR_DEFAULT = "/tmp"  # torch_memory_saver's, without TMS_DISK_BACKUP_DIR (csrc/disk_backend.cpp)
# A host-store limit below the store's 2 MiB block puts every backup beyond it: in pageable memory,
# or with a spill directory on disk (torpor/pool.hpp, PoolOptions::host_store_limit).
_EVERY_BACKUP_BEYOND_THE_LIMIT = 1


def check_backup_backend(enable_cpu_backup: bool, cpu_backup_backend: Optional[str]) -> None:
    if cpu_backup_backend is None:
        return
    if not enable_cpu_backup:
        raise InvalidArgument("cpu_backup_backend requires enable_cpu_backup=True")
    if cpu_backup_backend not in CPU_BACKUP_BACKENDS:
        raise InvalidArgument(
            f"cpu_backup_backend {cpu_backup_backend!r} is not one of {', '.join(CPU_BACKUP_BACKENDS)}"
        )


def default_backup_backend() -> str:
    """TMS_INIT_CPU_BACKUP_BACKEND, or "pinned" (torch_memory_saver's cpu_backup_kind_from_str: an
    unset or empty value is pinned, anything but mmap or pinned an error)."""
    value = environment.text("TMS_INIT_CPU_BACKUP_BACKEND")
    if not value:
        return "pinned"
    if value not in CPU_BACKUP_BACKENDS:
        raise InvalidArgument(
            f"TMS_INIT_CPU_BACKUP_BACKEND={value!r} is not one of {', '.join(CPU_BACKUP_BACKENDS)}: "
            f"set it to one of them, or unset it for pinned"
        )
    return value


def _store_request(disk_dir: Optional[str]) -> Optional[tuple[int, Optional[str]]]:
    """The host-store options (host_store_limit, spill_dir) the torch_memory_saver settings ask of
    torpor's pools, or None for torpor's own (every backup page-locked)."""
    if disk_dir is not None:
        return (_EVERY_BACKUP_BEYOND_THE_LIMIT, disk_dir)
    if default_backup_backend() == "mmap":
        return (_EVERY_BACKUP_BEYOND_THE_LIMIT, None)
    return None


def _store_reason(wanted: tuple) -> str:
    if wanted[1] is not None:
        return f"disk backup into {wanted[1]!r}"
    return "cpu_backup_backend mmap (TMS_INIT_CPU_BACKUP_BACKEND)"


class Regions:
    """The state a TorchMemorySaver's hook modes share (see the module note)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tags: set[str] = set()  # every tag a region or a cuda_graph created
        self.mem_pools: dict = {}  # torch_memory_saver's _mem_pools: (tag, cpu, disk, backend, device) -> MemPool
        self.retain_cpu_backup = environment.enabled("TMS_RETAIN_CPU_BACKUP")
        self.disk_dir: Optional[str] = environment.text("TMS_DISK_BACKUP_DIR") or None
        self.store_applied: Optional[tuple] = None  # the host-store options put on the pools

    def apply_store(self, disk: bool) -> None:
        """Put the host-store options that the backup settings ask for on torpor's pools, once,
        before their first allocation (`disk`: a region with enable_disk_backup asks for one)."""
        with self.lock:
            disk_dir = self.disk_dir
            if disk and disk_dir is None:
                disk_dir = DISK_DIR_DEFAULT
            wanted = _store_request(disk_dir)
            if wanted is None or wanted == self.store_applied:
                return
            try:
                engine.reconfigure(
                    host_store_limit=wanted[0], spill_dir=wanted[1], spill_file_per_allocation=wanted[1] is not None
                )
            except InvalidState as e:
                raise Unavailable(
                    f"torpor.tms: {_store_reason(wanted)} needs torpor's pools configured for it, and they "
                    f"already hold memory ({e}); torpor's host store is per pool: set it before the first "
                    f"CUDA allocation in a region (set TMS_DISK_BACKUP_DIR / TMS_INIT_CPU_BACKUP_BACKEND in the "
                    f"environment, or call set_disk_backup_dir first)"
                ) from None
            self.store_applied, self.disk_dir = wanted, disk_dir  # only once the pools took it

    def use_disk_dir(self, path: str) -> None:
        """Make `path` the disk backups' directory and put it on the pools; nothing kept if they
        cannot take it any more."""
        with self.lock:
            previous, self.disk_dir = self.disk_dir, path
        try:
            self.apply_store(disk=True)
        except Exception:
            with self.lock:
                self.disk_dir = previous
            raise


__all__ = ["Regions", "check_backup_backend", "default_backup_backend"]
