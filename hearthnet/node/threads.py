"""One OpenMP team per node process: the event loop's torch work runs serially.

torch's CPU kernels (ATen's `parallel_for`, oneDNN) parallelise with OpenMP, and libgomp
keeps a team of helper threads for every thread that has run a parallel region. A node
computes on its one compute thread (`daemon.Node.executor`); if the event loop thread
also runs a parallel region — converting or checking a prefill-sized tensor is enough —
the process holds two teams, more threads than CPUs, and libgomp then cuts its spin-wait
to ~100 iterations: every parallel region of the compute thread pays a futex wake-up. On
this 2-core machine that made 18 int8 layers of a 3B shape 67 → 72 ms per token
(docs/benchmarks.md, "Real scale").

`serial_torch_here()` makes the calling thread's torch ops serial (its OpenMP ICV
nthreads-var and MKL's thread-local count are 1, so `parallel_for` and MKL run inline and
open no team) and releases the team it may already hold (`omp_pause_resource_all`), while
every other thread keeps `torch.set_num_threads`'s count. The event loop only converts,
checks and relays tensors, so it loses nothing.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

_OPENMP = ("libgomp", "libiomp", "libomp")  # GNU (pip wheels), Intel, LLVM
_MKL = ("libtorch_cpu", "libmkl_rt")  # torch links MKL in statically, or it is loaded


def _mapped_with(names: tuple[str, ...], symbol: str) -> ctypes.CDLL | None:
    """A shared library mapped into this process (Linux) whose file name contains one of
    `names` and that exports `symbol` — the instance torch uses — or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if any(n in path.rsplit("/", 1)[-1] for n in names):
            try:
                lib = ctypes.CDLL(path)  # already mapped: the same instance
                getattr(lib, symbol)
                return lib
            except (OSError, AttributeError):
                continue
    return None


@cache
def _openmp() -> ctypes.CDLL | None:
    return _mapped_with(_OPENMP, "omp_set_num_threads")


@cache
def _mkl() -> ctypes.CDLL | None:
    # the C entry point: MKL also exports the name in lower case for Fortran (by pointer)
    return _mapped_with(_MKL, "MKL_Set_Num_Threads_Local")


def serial_torch_here() -> bool:
    """Run this thread's torch ops serially; False where no OpenMP runtime is found."""
    lib = _openmp()
    if lib is None:
        return False
    torch.get_num_threads()  # torch's per-thread init first, or it would undo the next line
    lib.omp_set_num_threads(ctypes.c_int(1))
    mkl = _mkl()  # MKL's vector maths (sin, cos, exp of rope tables) opens its own teams
    if mkl is not None:
        mkl.MKL_Set_Num_Threads_Local(ctypes.c_int(1))
    pause = getattr(lib, "omp_pause_resource_all", None)  # OpenMP 5.0
    if pause is not None:  # let go of the team this thread may already hold (torch's
        pause(ctypes.c_int(1))  # start-up runs parallel regions): omp_pause_soft
    return torch.get_num_threads() == 1
