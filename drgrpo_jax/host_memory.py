"""A process's memory (the trainer's, the service's): its peak RSS, what the host has left, and glibc's freed pages
handed back to the OS."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import sys
from typing import Any

import jax

__all__ = ["available_bytes", "mapped_fraction", "peak_rss_gb", "return_freed_memory", "returning_compile_memory"]


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GiB (the trainer's own, not its child service's)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def available_bytes() -> int:
    """The host memory new allocations can take now without swapping: Linux's MemAvailable (free pages and the
    reclaimable cache), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def mapped_fraction() -> float:
    """The share of Linux's per-process limit on memory mappings (vm.max_map_count) this process holds; 0 elsewhere.

    XLA's CPU backend maps each compiled kernel's code and data on its own (~1000 regions for the tiny model's
    sampler programs), and jax keeps every program it compiled: a process compiling many distinct programs passes
    the limit (65530 by default), and the compile whose mmap then fails dies with a segfault.
    """
    try:
        with open("/proc/sys/vm/max_map_count") as limit, open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps) / int(limit.read())
    except (OSError, ValueError):
        return 0.0


def return_freed_memory() -> None:
    """Hands the C heap's freed pages back to the OS (glibc; a no-op elsewhere).

    A checkpoint save or an evaluation frees many small allocations that glibc keeps in its arenas, so without
    this the next update's buffers come on top of them and raise the trainer's peak memory.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event after each XLA compile


_trimming_after_compiles = False


def _trim_after_compile(event: str, duration: float, **kwargs: Any) -> None:
    if _trimming_after_compiles and event == _BACKEND_COMPILE:
        return_freed_memory()


@contextlib.contextmanager
def returning_compile_memory():
    """Within it, what each XLA compile freed goes back to the OS before its program first runs.

    glibc keeps what compiling the train step freed, and the first update's buffers would come on top of it
    (`benchmarks/train_step.py` reports the peak RSS).
    """
    global _trimming_after_compiles
    _register_once(jax.monitoring.register_event_duration_secs_listener)
    _trimming_after_compiles = True
    try:
        yield
    finally:
        _trimming_after_compiles = False


@functools.cache
def _register_once(register: Any) -> None:
    register(_trim_after_compile)  # jax has no public way to take a listener off again: the flag turns it off
