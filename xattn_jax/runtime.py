"""Process setup that has to happen before JAX starts: tell glibc's allocator to keep freed memory.

XLA:CPU allocates a step's temporaries afresh at every execution and frees them at its end. glibc
serves large blocks, and every block requested from a worker thread's arena, with `mmap` and
returns them to the kernel on `free`, so the next step faults every page in again, zero-filled.
On the translator benchmark (d_model 512, 3 + 3 layers, batch 32 x 64) that was ~230,000 page
faults (~900 MB of fresh pages) and ~0.4 s of kernel time in every ~1.65 s training step. With one
arena, no `mmap` and no trimming, freed blocks are reused, the faults vanish and the step takes
~1.51 s; attention at length 512 gains about as much (see experiments/results/).

glibc reads `GLIBC_TUNABLES` once, when the process starts, so `reexec_with_tuned_allocator()`
re-executes the current command (same interpreter, same arguments) with the settings in its
environment, once. It does nothing when `GLIBC_TUNABLES` is already set (your own choice wins),
off Linux/glibc, or with `XATTN_ALLOCATOR=default` in the environment. The price: memory the
process has freed stays reserved for it (resident size stays at its peak), which is what a
training or benchmark process wants anyway. torch in the same process uses the same allocator,
so side-by-side benchmarks keep comparing like with like.

Only the entry points (launch.py, experiments/*.py) call it, first thing under `__main__`. This
module imports nothing heavy, so calling it costs nothing before the re-exec.
"""
from __future__ import annotations

import os
import platform
import sys

# One arena (worker threads share the main heap instead of mmap'd per-thread heaps), never serve
# an allocation by mmap, never give the top of the heap back to the kernel.
GLIBC_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                  "glibc.malloc.trim_threshold=17179869184")
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
