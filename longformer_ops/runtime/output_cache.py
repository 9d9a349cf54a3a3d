"""Recycled memory for the CPU kernels' outputs, as torch's CUDA caching allocator does on GPUs.

Why: torch's CPU allocator takes a large tensor straight from the OS and gives it back when the
tensor is freed (glibc ``mmap``/``munmap`` for large blocks), so every call that returns a fresh
band pays the OS for zeroed pages again, a large share of a band product's time.

Outputs of at least ``MIN_BYTES`` on CPU come from here instead (and ``dense.py``'s float32
temporaries, as large as activations and made for every product): a private anonymous mapping,
wrapped as a tensor (``torch.frombuffer``). When the last tensor using it
is freed (every view holds it), the mapping is parked, and the next output of the same byte size
reuses it, its pages already in place. The kernels overwrite every element of their outputs, so
old contents never show. Parked bytes are bounded by ``LONGFORMER_OPS_OUTPUT_CACHE_MIB`` (default
1024; 0 parks nothing), the least recently parked released first; :func:`empty_cache` releases
them all. Memory in use is never held back: only freed outputs are parked.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref

import torch

CACHE_LIMIT_ENV = "LONGFORMER_OPS_OUTPUT_CACHE_MIB"
DEFAULT_LIMIT_MIB = 1024
# Smaller outputs take torch's allocator: malloc recycles them itself, and a mapping per call
# (a system call and a finaliser) would cost more than such a kernel saves.
MIN_BYTES = 1 << 20

_parked: list[mmap.mmap] = []  # freed mappings, least recently parked first
_lock = threading.RLock()  # re-entrant: freeing a tensor inside take() parks from the same thread


def limit_bytes() -> int:
    """The most bytes parked at once, from ``LONGFORMER_OPS_OUTPUT_CACHE_MIB``."""
    value = os.environ.get(CACHE_LIMIT_ENV, str(DEFAULT_LIMIT_MIB))
    try:
        mib = float(value)
    except ValueError:
        mib = -1.0
    if not (math.isfinite(mib) and mib >= 0):
        raise ValueError(f"{CACHE_LIMIT_ENV} must be a number of MiB >= 0 (0: cache nothing), got {value!r}")
    return int(mib * 2**20)


def new_output(like: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s device and dtype (or ``dtype``); on CPU
    from ``MIN_BYTES`` on, recycled memory (see the module docstring)."""
    dtype = like.dtype if dtype is None else dtype
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    if like.device.type != "cpu" or nbytes < max(MIN_BYTES, 1):  # (no mapping is empty)
        return like.new_empty(shape, dtype=dtype)
    limit_bytes()  # a bad setting is reported here, to the caller, not later inside a finaliser
    mapping = _take(nbytes)
    view = memoryview(mapping)
    # The storage keeps `view` alive as long as any tensor uses the memory; then park the mapping.
    weakref.finalize(view, _park, mapping).atexit = False
    storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
    # A tensor of its own on that storage, not a view of frombuffer's: autograd forbids in-place
    # changes to a view returned by a custom Function (the layer fills its score band in place).
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def empty_cache() -> int:
    """Release every parked output mapping to the OS; returns the bytes released."""
    with _lock:
        released = sum(len(mapping) for mapping in _parked)
        _parked.clear()
    return released


def _take(nbytes: int) -> mmap.mmap:
    with _lock:
        for index in range(len(_parked) - 1, -1, -1):  # most recently parked first: its pages are warmest
            if len(_parked[index]) == nbytes:
                return _parked.pop(index)
    # Private, as malloc's memory: a forked child (a DataLoader worker) writing to an output copies
    # the page instead of changing the parent's. Python's default, MAP_SHARED, is shmem.
    # No transparent-huge-page advice: faults are rare once outputs are reused, and advised
    # faults can stall on the kernel's memory compaction.
    if hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))
    return mmap.mmap(-1, nbytes)  # Windows: anonymous mappings are private already


def _park(mapping: mmap.mmap) -> None:
    try:
        limit = limit_bytes()
    except ValueError:
        limit = 0  # the setting turned bad after the output was made: keep nothing
    with _lock:
        _parked.append(mapping)
        total = sum(len(kept) for kept in _parked)
        while _parked and total > limit:
            total -= len(_parked.pop(0))  # dropping the last reference unmaps it
