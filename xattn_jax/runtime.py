"""Process setup that has to happen before JAX starts: transparent huge pages for glibc's allocator.

XLA:CPU allocates a step's temporaries afresh at every execution and frees them at its end. glibc
serves large blocks with `mmap` and returns them to the kernel on `free`, so the next step faults
every page in again, zero-filled, 4 KiB at a time: on the translator benchmark (d_model 512,
3 + 3 layers, batch 32 x 64) ~230,000 page faults and ~0.4 s of kernel time in every ~1.65 s
training step. With `glibc.malloc.hugetlb=1` glibc asks for transparent huge pages on what it
maps (where the kernel's THP mode is `madvise`, as on most distributions): ~1,000 faults of 2 MiB
per step, the step ~1.55 s; the small date translator (the main job) gains ~2%.

Measured and rejected: one malloc arena with no mmap and no trimming removes the faults entirely
(~1.50 s) but serializes the allocations of XLA's threads: the main job ran 25% slower. More
tcache entries made both slower.

glibc reads `GLIBC_TUNABLES` once, when the process starts, so `reexec_with_tuned_allocator()`
re-executes the current command (same interpreter, same arguments) with the setting in its
environment, once. It does nothing when `GLIBC_TUNABLES` is already set (your own choice wins),
off Linux/glibc, or with `XATTN_ALLOCATOR=default` in the environment. torch in the same process
uses the same allocator, so side-by-side benchmarks keep comparing like with like.

Only the entry points (launch.py, experiments/bench_*.py) call it, first thing under `__main__`.
This module imports nothing heavy.
"""
from __future__ import annotations

import os
import platform
import sys

GLIBC_TUNABLES = "glibc.malloc.hugetlb=1"
OPT_OUT_VARIABLE = "XATTN_ALLOCATOR"


def tuned_allocator_active() -> bool:
  """Whether this process started with the settings above."""
  return os.environ.get("GLIBC_TUNABLES") == GLIBC_TUNABLES


def reexec_with_tuned_allocator() -> None:
  """Re-execute this program with GLIBC_TUNABLES set, unless already set, opted out, or not glibc."""
  if "GLIBC_TUNABLES" in os.environ or os.environ.get(OPT_OUT_VARIABLE) == "default":
    return
  if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
    return
  os.environ["GLIBC_TUNABLES"] = GLIBC_TUNABLES
  sys.stdout.flush()
  sys.stderr.flush()
  # orig_argv keeps interpreter options (-u, -X ...) as well as the script and its arguments.
  os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
