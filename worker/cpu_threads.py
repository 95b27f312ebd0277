"""The CPU forward's OpenMP threads. libgomp keeps a pool of worker threads per thread that ever started a
parallel region; once more threads sit in pools than the machine has cores it throttles their spinning, so every
later region pays to wake its workers. The model is loaded and warmed up on the caller's thread, then the loop
thread runs every forward: the caller's idle pool would make each of them slower (on 2 cores, a 64 x 4096 SiLU
124 us against 47; a TP=1 step about a quarter). `release_openmp_pool` frees the calling thread's pool (OpenMP
5.0's omp_pause_resource_all); the thread makes a new one if it runs a parallel region again."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("lockstep")
OMP_PAUSE_HARD = 2


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's CPU builds link it), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP pool (call it outside any parallel region, after the work it did). True
    when libgomp said it did; False where there is no libgomp (another OpenMP runtime, another platform)."""
    lib = _libgomp()
    if lib is None:
        return False
    done = lib.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
    if not done:
        log.debug("lockstep: omp_pause_resource_all refused; the caller's OpenMP pool stays")
    return done
