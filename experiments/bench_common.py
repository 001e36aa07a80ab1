"""What the benchmark scripts share: interleaved medians, and where results go.

Every script writes to experiments/results/ by default; with --quick (tiny sizes, a smoke run) it
writes to a fresh temporary directory instead, so a smoke run never replaces recorded results.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def add_output_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
  parser.add_argument("--out", "--out_dir", dest="out", default=None,
                      help="directory for the results (default: experiments/results, or a new temporary directory "
                           "with --quick)")


def parse_output_args(parser: argparse.ArgumentParser, name: str, argv=None) -> argparse.Namespace:
  """Parses the arguments and makes the output directory at once (args.out), so a bad --out stops the
  script before minutes of measuring instead of after."""
  args = parser.parse_args(argv)
  try:
    args.out = str(output_dir(args, name))
  except OSError as error:
    parser.error(f"--out {args.out}: {error.strerror or error}")
  return args


def output_dir(args: argparse.Namespace, name: str) -> pathlib.Path:
  """--out if given; else experiments/results, or a new temporary directory for --quick runs."""
  # --out=~/x: the shell leaves a ~ after "=" as it is
  out = pathlib.Path(args.out or (tempfile.mkdtemp(prefix=f"{name}_quick_") if args.quick else RESULTS)).expanduser()
  out.mkdir(parents=True, exist_ok=True)
  return out


def write_results(out, stem: str, record, markdown: str) -> None:
  """Writes out/<stem>.json (the record) and out/<stem>.md (the markdown), and says where."""
  out = pathlib.Path(out)
  (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
  (out / f"{stem}.md").write_text(markdown)
  print(f"wrote {out / stem}.md and .json")


def multi_step_call(step, state, batches, steps_per_call: int):
  """run(): one call of a jitted `trainer.multi_step` program `step` over `batches` (each stacked
  [steps_per_call, ...]), carrying the training state from call to call; blocks on the loss."""
  import jax  # the torch-only scripts import this module too
  import jax.numpy as jnp
  holder = {"state": state}
  first, count, key = jnp.int32(0), jnp.int32(steps_per_call), jax.random.key(0)

  def run():
    holder["state"], metrics = step(holder["state"], batches, first, count, key)
    metrics["loss"].block_until_ready()

  return run


def median_seconds(fn, repeats: int, warmup: bool = True) -> float:
  """Median wall time of fn() over `repeats` runs after one warm-up run; fn blocks until done."""
  if warmup:
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def blocked_median_seconds(fns: dict, blocks: int, per_block: int, warmup: int = 3,
                           drop_first: bool = True) -> dict:
  """{name: median wall time of fn()} over `blocks` rounds in which each function runs `per_block`
  times back to back (a a a b b b a a a ...). For short calls (milliseconds) this times each
  library in its steady state: right after a torch call its OpenMP workers still spin on the cores
  for a few milliseconds (a 3.7 ms JAX matmul took 6.8 ms straight after torch's), and after an
  idle pause XLA's workers wake slowly; back to back, neither happens. Blocks alternate, so a
  change in machine load still hits every function alike. With drop_first, each block first runs
  once untimed."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  times = {name: [] for name in fns}
  for _ in range(blocks):
    for name, fn in fns.items():
      for i in range(per_block + drop_first):
        start = time.perf_counter()
        fn()
        if i >= drop_first:
          times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def interleaved_median_seconds(fns: dict, repeats: int, warmup: int = 3) -> dict:
  """{name: median wall time of fn()} with the functions' runs interleaved (a, b, a, b, ...), so a
  change in machine load hits them all alike; each first runs `warmup` times (compilation, and the
  allocator reaching its steady state: the first steps of a process still grow its heap)."""
  return blocked_median_seconds(fns, blocks=repeats, per_block=1, warmup=warmup, drop_first=False)


# --- the machine's limit for a piece of work (a roofline: FLOPs at the matmul rate, bytes at the copy bandwidth)

MATMUL_FLOPS, COPY_MEGABYTES = 2 * 2048 ** 3, 256


def _matmul_2048():
  """A function running one float32 2048^3 matmul (MATMUL_FLOPS) to completion."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048)), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  return lambda: matmul(a, a).block_until_ready()


def machine_rate_probes(runs: int = 1) -> dict:
  """{name: fn} timing this machine's rates, each fn `runs` times over: the 2048^3 matmul and copies of a
  COPY_MEGABYTES float32 array by numpy and by a jitted JAX op; `machine_rates` turns their times into rates.
  Time them in the same interleaved rounds as the work they bound: the machine's speed drifts."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  n = COPY_MEGABYTES * 2 ** 20 // 4
  source, target, x = np.ones(n, np.float32), np.empty(n, np.float32), jnp.ones(n, jnp.float32)
  copy = jax.jit(lambda x: x + 1.0)
  probes = {"rate_matmul_2048": _matmul_2048(),
            "rate_copy_numpy": lambda: np.copyto(target, source),
            "rate_copy_jax": lambda: copy(x).block_until_ready()}
  return {name: (lambda f=f: [f() for _ in range(runs)]) for name, f in probes.items()}


def machine_rates(seconds: dict, runs: int = 1) -> tuple[float, float]:
  """(matmul FLOP/s, copy bandwidth in bytes read + written per second: the faster copy) from the median
  seconds of `machine_rate_probes(runs)`."""
  copy_bytes = 2 * COPY_MEGABYTES * 2 ** 20
  return (MATMUL_FLOPS * runs / seconds["rate_matmul_2048"],
          copy_bytes * runs / min(seconds["rate_copy_numpy"], seconds["rate_copy_jax"]))


def machine_limit_seconds(work, matmul_rate, bandwidth):
  """The least time for `work` = (FLOPs run once, [(FLOPs, bytes) per step]) on this machine: each step takes
  the larger of its FLOPs at the matmul rate and its bytes at the copy bandwidth (a roofline, perfect overlap
  within a step)."""
  once, steps = work
  return once / matmul_rate + sum(max(flops / matmul_rate, moved / bandwidth) for flops, moved in steps)


def matmul_flops_per_second(repeats):
  return MATMUL_FLOPS / median_seconds(_matmul_2048(), max(repeats, 5))


def parse_jax_vs_torch_args(doc: str, full: dict, quick: dict, add_arguments=None, tensor_devices: bool = False):
  """(args, sizes, cores) for a script comparing JAX with torch: --quick / --out parsed (and the script's own
  flags, which add_arguments(parser) adds), the sizes it picks, and torch given as many threads as XLA's CPU
  backend uses (every core this process may use). With tensor_devices, --tensor_devices N (default: the cores)
  gives JAX N CPU devices for the script's tensor-parallel rows (`tensor_parallel`), set here, before JAX starts."""
  import torch  # only the JAX-vs-torch scripts need it

  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  add_output_flags(parser)
  cores = len(os.sched_getaffinity(0))
  if tensor_devices:
    parser.add_argument("--tensor_devices", type=int, default=cores,
                        help="JAX CPU devices for the tensor-parallel rows, the model's heads / MLP / vocabulary split "
                             "over them, one core each; 1 leaves those rows out (default: the cores, %(default)s)")
  if add_arguments is not None:
    add_arguments(parser)
  args = parse_output_args(parser, pathlib.Path(sys.argv[0]).stem)
  if tensor_devices:
    if args.tensor_devices < 1:
      parser.error(f"--tensor_devices must be >= 1, got {args.tensor_devices}")
    if args.tensor_devices > 1:
      import jax
      jax.config.update("jax_num_cpu_devices", args.tensor_devices)
  torch.set_num_threads(cores)
  return args, (quick if args.quick else full), cores


def tensor_parallel(model, devices: int):
  """(the model placed over a (data=1, tensor=devices) mesh of CPU devices by the launcher's default rules,
  put(x) placing an input replicated there, where its logits lie: `sharding.logits_sharding`), or None where
  that cannot run: devices < 2, a backend other than CPU, or fewer CPU devices in this process
  (parse_jax_vs_torch_args(tensor_devices=True) makes them)."""
  import jax
  from configs import common
  from xattn_jax.training import sharding

  if devices < 2 or jax.default_backend() != "cpu" or len(jax.devices()) < devices:
    return None
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": devices}, jax.devices()[:devices])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return (sharding.place_model(model, mesh, common.DEFAULT_SHARDING_RULES),
          lambda x: jax.device_put(x, replicated), sharding.logits_sharding(mesh, common.DEFAULT_SHARDING_RULES))


class HostContention:
  """What else used the machine while a benchmark ran: a load average read before the start says little
  once the benchmark itself keeps the cores busy. Created at the start; `summary()` at the end gives

    other_processes_cores: the cores' busy seconds not spent by this process or its waited-for children,
      per second of wall time (0 = nothing else ran; 1 = another job took a whole core);
    steal_fraction: the share of the cores' time the hypervisor gave to other machines (virtual cores
      waiting for a physical one), which no load average shows.

  Linux only (/proc/stat); elsewhere summary() is None."""

  def __init__(self):
    self._start = self._snapshot()

  @staticmethod
  def _snapshot():
    import resource
    try:
      fields = pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
      return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return time.monotonic(), ticks, own

  def summary(self) -> dict | None:
    end = self._snapshot()
    if self._start is None or end is None:
      return None
    (t0, ticks0, own0), (t1, ticks1, own1) = self._start, end
    delta = [b - a for a, b in zip(ticks0, ticks1)]
    hz = os.sysconf("SC_CLK_TCK")
    busy = (delta[0] + delta[1] + delta[2] + delta[5] + delta[6]) / hz
    wall = max(t1 - t0, 1e-9)
    return {"other_processes_cores": round(max(0.0, busy - (own1 - own0)) / wall, 3),
            "steal_fraction": round(delta[7] / max(sum(delta), 1), 3), "wall_s": round(wall, 1)}

  @staticmethod
  def describe(summary: dict | None) -> str:
    """The summary as the results files print it."""
    if summary is None:
      return "other processes' use of the cores during the run: not measured (no /proc/stat)"
    return (f"during the run other processes used {summary['other_processes_cores']:.2f} cores and the "
            f"hypervisor stole {100 * summary['steal_fraction']:.0f}% of the cores' time")


def cpu_description(cpuinfo: str | None = None) -> str:
  """The processor, as /proc/cpuinfo (or the text ``cpuinfo``) names it, with its widest vector ISA and its
  family / model numbers: "AMD EPYC (AVX2; family 23 model 1)". Timings from different processors do not
  compare, this project's 2-core machines have changed between runs, and a hypervisor may name two
  generations alike ("AMD EPYC"): the numbers tell them apart."""
  if cpuinfo is None:
    try:
      cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
      import platform
      return platform.processor() or "unknown processor"
  fields = {}
  for line in cpuinfo.splitlines():  # the first processor's block: every core of a machine reads alike
    key, sep, value = line.partition(":")
    if sep:
      fields.setdefault(key.strip(), value.strip())
  model = " ".join(fields.get("model name", "unknown").split())
  flags = set(fields.get("flags", "").split())
  isa = [name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags]
  described = ", ".join(isa[:2]) or "no AVX2"
  numbers = " ".join(f"{name} {fields[key]}" for key, name in (("cpu family", "family"), ("model", "model"))
                     if fields.get(key))
  return f"{model} ({described}; {numbers})" if numbers else f"{model} ({described})"


# `git status` of the tracked files that differ from the commit, results files aside: a run writes those, and
# they change no code, so a run after another is still of its commit
DIRTY_STATUS = ("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)experiments/results")


def provenance(argv=None) -> dict:
  """What a results file records about its run: the commit (and whether the tree had local changes), the
  UTC date, the 1-minute load average now (call it before measuring) and the exact command."""
  import datetime
  import shlex
  import subprocess
  repo = pathlib.Path(__file__).resolve().parent.parent
  def git(*args):
    try:
      return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return ""
  return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git(*DIRTY_STATUS)),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "load_average_before": os.getloadavg()[0], "cpu_cores": os.cpu_count(), "cpu": cpu_description(),
          "command": " ".join(shlex.quote(a) for a in ["python", *(sys.argv if argv is None else argv)])}


def commit_label(record: dict, length: int | None = 7) -> str:
  """The commit of a provenance() record as every results file prints it: the hash's first `length` characters
  (None: all), then "+changes" when the work tree had local changes; "unknown" outside a git checkout."""
  return (record["commit"][:length] or "unknown") + ("+changes" if record["dirty"] else "")


def provenance_line(record: dict, commit_length: int | None = 7) -> str:
  """The sentence every results file gives its run, from a provenance() record: the commit (`commit_label`), the
  date, the exact command and the 1-minute load average before the start."""
  return (f"Commit `{commit_label(record, commit_length)}`, {record['date']}, `{record['command']}`; 1-minute load "
          f"average {record['load_average_before']:.1f} before the start.")


def run_record() -> dict:
  """{"commit": commit_label (the short hash, "+changes" when the work tree differs from it), "command": the
  exact command line, "cpu": the processor}: provenance() in the compact form the speed tables print."""
  record = provenance()
  return {"commit": commit_label(record), "command": record["command"], "cpu": record["cpu"]}

