"""What the sweep runners share (experiments/ablate_positions.py, experiments/length_generalization.py).

A cell is one `launch.py` subprocess in its own workdir (the runner's Cell gives `workdir(root)` and
`command(root, quick)`); its result is the final eval's metrics, read from the run's metrics.jsonl and kept in
result.json, so a finished cell is never trained again and an interrupted one resumes from its checkpoint
(launch.py's own resume). result.json also keeps the cell's settings (its launch arguments) and the commit it
trained at. A finished cell is stale when its settings differ from what the runner would launch now (another
budget, another commit's grid) or when the config its workdir recorded (config.json) differs from the one its
command resolves to now (another commit's config file or defaults): it is neither reused nor trained over, and no
table counts it. A table row is the mean and sample std of a metric over every seed that finished on disk.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))  # run as a script (its --help) too, not only imported by the runners

from xattn_jax.training import records  # noqa: E402


def final_metrics(workdir: pathlib.Path, keys) -> dict[str, float]:
  """The last logged value of each key in workdir/metrics.jsonl (the final eval)."""
  values = {}
  with open(workdir / "metrics.jsonl") as f:
    for number, line in enumerate(f, 1):
      try:
        row = json.loads(line)
      except json.JSONDecodeError as error:  # a line cut short by a kill: named, as a run's own data errors are
        raise RuntimeError(f"{workdir / 'metrics.jsonl'}:{number}: not valid JSON ({error.msg})") from None
      values.update({k: row[k] for k in keys if k in row})
  missing = [k for k in keys if k not in values]
  if missing:
    raise RuntimeError(f"{workdir}: metrics.jsonl has no {missing}")
  return values


def settings(command: list[str]) -> list[str]:
  """A cell's launch arguments without the interpreter, the repository's path or the workdir: what a result
  was trained with, wherever the repository and the sweep's root sit."""
  prefix = str(REPOSITORY) + os.sep
  return [argument.replace(prefix, "") for argument in command[1:] if not argument.startswith("--workdir=")]


def resolved_config(command: list[str]):
  """The config launch.py would train `command` with: its --config flags parsed as launch.py parses them (the
  config file's get_config, then the overrides), nothing built or trained; None for a command not launch.py's."""
  from absl import flags
  from ml_collections import config_flags
  if len(command) < 2 or pathlib.Path(command[1]).name != "launch.py":
    return None
  argv = ["launch.py", *(argument for argument in command[2:] if argument.startswith("--config"))]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  return values.config


def config_changes(command: list[str], workdir: pathlib.Path) -> dict[str, tuple]:
  """{field: (value the run in workdir recorded, value `command` resolves to now)} where they differ; {} without a
  recorded config.json or for a command not launch.py's. A field one side lacks is not compared (a run older than
  the field, as compare_connectors.other_run does)."""
  from xattn_jax.training import workdir as workdir_lib
  if not (workdir / "config.json").is_file():
    return {}
  config = resolved_config(command)
  if config is None:
    return {}
  return {field: values for field, values in workdir_lib.config_differences(config, str(workdir)).items()
          if None not in values}


def stale(cell, root: pathlib.Path, quick: bool, result: dict) -> str:
  """Why a finished cell's result is not the cell's under the current settings ("" if it is): other launch
  arguments, or a recorded config that differs from what the command resolves to now (`config_changes`). A
  result.json written before settings were kept is compared on its config alone."""
  workdir, command = cell.workdir(root), cell.command(root, quick)
  recorded, current = result.get("settings"), settings(command)
  if recorded is not None and recorded != current:
    differences = sorted(set(recorded) ^ set(current)) or ["the order of the arguments"]
    return (f"STALE: {workdir} was trained with other settings ({', '.join(differences[:4])}); delete it "
            f"to train the cell again, or use another --workdir")
  changes = config_changes(command, workdir)
  if not changes:
    return ""
  fields = ", ".join(f"{field}={old!r}, now {new!r}" for field, (old, new) in list(changes.items())[:4])
  trained_at = f" at commit {result['commit']}" if result.get("commit") else ""
  return (f"STALE: {workdir} was trained{trained_at} with a config the same command no longer resolves to "
          f"({fields}); delete it to train the cell again, or use another --workdir")


@functools.cache
def head_commit() -> str:
  """The commit the cells train at, as results files name it (bench_common.commit_label: the whole hash, then
  "+changes" for local changes)."""
  from experiments import bench_common
  return bench_common.commit_label(bench_common.provenance([]), None)


def other_commit(result: dict) -> str:
  """A note where a reused result was trained at another commit than HEAD ("" where not, or where it predates
  the record): its config resolves the same (else it is `stale`), but the code may differ."""
  trained = result.get("commit")
  if not trained or trained.split("+")[0] == head_commit().split("+")[0]:
    return ""
  return f" (trained at commit {trained[:10]}, HEAD is {head_commit()[:10]}: same config, maybe other code)"


def read_result(path: pathlib.Path) -> dict:
  """A cell's result.json; ValueError naming the file and line where it is not a JSON object (a write cut short by
  a full disk or a kill, a hand edit)."""
  try:
    result = json.loads(path.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"{path}:{error.lineno}: not valid JSON ({error.msg}); delete it to train the cell "
                     "again") from None
  if not isinstance(result, dict):
    raise ValueError(f"{path}:1: not a JSON object of metrics; delete it to train the cell again")
  return result


def finished_result(cell, root: pathlib.Path, quick: bool) -> dict | None:
  """The cell's kept result, or None when it has none, a stale one or one that does not read (`read_result`:
  run_cell names it)."""
  path = cell.workdir(root) / "result.json"
  if not path.exists():
    return None
  try:
    result = read_result(path)
  except ValueError:
    return None
  return None if stale(cell, root, quick, result) else result


def finished_cells(rows, root: pathlib.Path, quick: bool) -> list[tuple]:
  """(cell, result) for every seed that finished on disk of each table row: `rows` holds a cell of each row (any
  seed), and every seed<k> folder beside its workdir with a result that is not stale (`finished_result`) counts,
  whatever seeds or rows this run asked for. The cells are dataclasses with a `seed` field."""
  finished = []
  for cell in _cells_on_disk(rows, root):
    result = finished_result(cell, root, quick)
    if result is not None:
      finished.append((cell, result))
  return finished


def _cells_on_disk(rows, root: pathlib.Path):
  """A cell for every seed<k> folder beside the workdir of each row's cell (any seed of the row)."""
  for folder, row in {row.workdir(root).parent: row for row in rows}.items():
    for seed in sorted(int(p.name[4:]) for p in folder.glob("seed*") if p.name[4:].isdigit()):
      yield dataclasses.replace(row, seed=seed)


def grouped(finished: list[tuple], key) -> dict:
  """{key(cell): [result of each seed]} of finished_cells."""
  results = {}
  for cell, result in finished:
    results.setdefault(key(cell), []).append(result)
  return results


def taken_from_disk(finished: list[tuple], todo, root: pathlib.Path, label, rows=()) -> str:
  """The line saying which finished cells the tables count that this run did not launch (rows --only left out,
  seeds beyond --seeds), by label(cell) (experiment or task) with their seeds, and naming each result.json of such a
  cell of `rows` (as finished_cells takes them) that does not read (`read_result`), which the tables leave out, as
  run_cell names a launched cell's; "" where there are none."""
  launched = {cell.workdir(root) for cell in todo}
  seeds = collections.defaultdict(list)
  for cell, _ in finished:
    if cell.workdir(root) not in launched:
      seeds[label(cell)].append(cell.seed)
  parts = []
  if seeds:
    parts.append(f"the tables also count finished cells this run did not launch, read from their result.json under "
                 f"{root}: " + "; ".join(f"{name} ({len(found)} cell{'s' * (len(found) != 1)}, seeds "
                                         f"{', '.join(map(str, sorted(set(found))))})" for name, found in seeds.items()))
  for cell in _cells_on_disk(rows, root):
    path = cell.workdir(root) / "result.json"
    if cell.workdir(root) in launched or not path.exists():
      continue
    try:
      read_result(path)
    except ValueError as error:  # left as it is, as run_cell leaves a launched cell's
      parts.append(f"WARNING: a cell this run did not launch is left out of the tables: {error}")
  return "; ".join(parts)


def run_cell(cell, root: pathlib.Path, quick: bool, keys, single_thread: bool):
  """Trains one cell unless its result.json exists; returns (cell, metrics or None, message). A result.json
  written before a key joined the table gains it from the run's log; a stale one (`stale`) is reported and
  left as it is."""
  root = pathlib.Path(root).absolute()  # the cell's launch.py runs in the repository, not the caller's folder
  workdir = cell.workdir(root)
  result_path = workdir / "result.json"
  if result_path.exists():
    try:
      result = read_result(result_path)
    except ValueError as error:  # left as it is: it may hold what a user wants back
      return cell, None, f"FAILED: {error}"
    reason = stale(cell, root, quick, result)
    if reason:
      return cell, None, reason
    if any(key not in result for key in keys):
      try:
        result.update(final_metrics(workdir, keys))
      except (OSError, RuntimeError) as error:  # a log deleted, or older than the key: the result stays as it is
        return cell, None, f"FAILED: {error}; delete {result_path} to train the cell again"
      records.write_atomically(str(result_path), json.dumps(result, indent=1) + "\n")
    return cell, result, "done before" + other_commit(result)
  if _STOPPING.is_set():  # Ctrl-C or SIGTERM came while this cell waited in the queue
    return cell, None, "not started: the runner was stopped"
  workdir.mkdir(parents=True, exist_ok=True)
  environment = dict(os.environ, PYTHONPATH=str(REPOSITORY))
  if single_thread:
    # Parallel jobs: one core each instead of every job spawning a thread pool over all cores.
    environment["XLA_FLAGS"] = (environment.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
  start = time.time()
  with open(workdir / "log.txt", "a") as log:
    process = subprocess.Popen(cell.command(root, quick), stdout=log, stderr=subprocess.STDOUT, env=environment,
                               cwd=REPOSITORY)
    with _LOCK:
      _RUNNING.add(process)
    try:
      status = process.wait()
    finally:
      with _LOCK:
        _RUNNING.discard(process)
  seconds = time.time() - start
  if status != 0:
    return cell, None, f"FAILED (exit {status}, {seconds:.0f}s): see {workdir / 'log.txt'}"
  try:
    metrics = final_metrics(workdir, keys)
  except (OSError, RuntimeError) as e:
    return cell, None, f"FAILED: {e}"
  # whole or not at all: a kill mid-write left a cut-short result.json
  records.write_atomically(str(result_path), json.dumps({**metrics, "train_seconds": seconds, "commit": head_commit(),
                                                         "settings": settings(cell.command(root, quick))}, indent=1)
                           + "\n")
  return cell, metrics, f"{seconds:.0f}s"


_STOPPING = threading.Event()
_RUNNING: set[subprocess.Popen] = set()
_LOCK = threading.Lock()


def run_cells(todo, run, jobs: int, report) -> None:
  """run(cell) for every cell, `jobs` at a time, report(cell, metrics, message) as each ends. Ctrl-C or SIGTERM
  starts no further cell and passes SIGTERM to the running ones' launch.py (each saves a checkpoint; the same
  command resumes it), then exits 130 / 143 in one line, the results files left as the last run wrote them."""
  def stop(signum, frame):
    del frame
    _STOPPING.set()
    with _LOCK:
      for process in _RUNNING:
        process.send_signal(signal.SIGTERM)
    raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

  previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
  pool = concurrent.futures.ThreadPoolExecutor(jobs)
  try:
    futures = [pool.submit(run, cell) for cell in todo]
    for future in concurrent.futures.as_completed(futures):
      report(*future.result())
  except (KeyboardInterrupt, SystemExit) as stopped:
    pool.shutdown(wait=True, cancel_futures=True)  # the running cells save and end
    code = stopped.code if isinstance(stopped, SystemExit) else 130
    print(f"{pathlib.Path(sys.argv[0]).name}: stopped; the running cells saved a checkpoint and the same command "
          "resumes them", file=sys.stderr, flush=True)
    sys.exit(code)
  finally:
    pool.shutdown(wait=True)
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    _STOPPING.clear()


def run_metadata(script: str, argv: list[str]) -> dict:
  """What a runner's results file records of its run: bench_common.provenance as the results print it (the commit
  by `commit_label`, whose local changes leave results files aside, so a resumed run that wrote its tables is still
  of its commit; the UTC date; the exact command of `script`), with the 1, 5 and 15-minute load averages now."""
  from experiments import bench_common
  record = bench_common.provenance([os.path.relpath(script, REPOSITORY), *argv])
  return {"commit": bench_common.commit_label(record, None), "date": record["date"],
          "load_average": [round(x, 2) for x in os.getloadavg()], "command": record["command"]}


def provenance_lines(meta: dict) -> list[str]:
  return [f"- commit `{meta['commit']}`, {meta['date']}, load average before the start "
          f"{meta['load_average']} (1, 5, 15 min)", f"- command: `{meta['command']}`"]


def check_folders(args, parser, flags=("workdir", "results")) -> None:
  """--workdir and --results (or the folders `flags` name) made absolute (a cell's launch.py runs in the
  repository: a relative workdir failed in orbax after training) and refused in one line, before any cell trains,
  where one is a file or lies under one (its mkdir failed after training)."""
  for flag in flags:
    value = getattr(args, flag)
    if value is None:
      continue
    if not value.strip():  # `--results=$OUT` with OUT unset wrote into the current folder
      parser.error(f"--{flag}={value!r}: empty; name a folder (it is made if missing)")
    path = pathlib.Path(value).expanduser().absolute()
    existing = next(folder for folder in (path, *path.parents) if folder.exists())  # the folder it is made in
    if not existing.is_dir():
      where = "is a file" if existing == path else f"lies under the file {existing}"
      parser.error(f"--{flag}={value}: {where}; name a folder (it is made if missing)")
    setattr(args, flag, str(path))


# Seeds a runner trains each cell with, at the most: the recorded tables use 3, and every seed is another pass over
# the whole grid (an hour or more on 2 cores); --seeds=1000 queued a thousand passes without a word.
MAX_SEEDS = 20


def check_jobs(jobs: int, parser) -> None:
  """--jobs refused in one line outside [1, twice this machine's cores]: each job is a launch.py process on one core
  (a single-threaded XLA), so more only slow each other down and fill the memory (--jobs=10000 started a process for
  every cell at once); twice the cores still lets one job compile or write while another computes."""
  most = 2 * (os.cpu_count() or 1)
  if not 1 <= jobs <= most:
    parser.error(f"--jobs={jobs}: must be in [1, {most}] (twice this machine's {most // 2} cores: each job is a "
                 "launch.py on one core)")


def check_seeds(flag_value, count: int, parser) -> None:
  """A --seeds asking for `count` seeds refused in one line outside [1, MAX_SEEDS]."""
  if not 1 <= count <= MAX_SEEDS:
    parser.error(f"--seeds={flag_value}: {count} seeds; allowed are 1 to {MAX_SEEDS} (each is another pass over "
                 "every cell)")


def seeds_to_run(args, parser) -> int:
  """The seeds a runner trains: 1 with --quick (saying so where --seeds asked for others), else --seeds."""
  if not args.quick:
    return args.seeds
  if args.seeds != parser.get_default("seeds"):
    print(f"--quick runs 1 seed a cell: --seeds={args.seeds} is not used", flush=True)
  return 1


def mean_std(runs: list[dict], keys) -> dict[str, dict]:
  """{key: {"mean", "std", "seeds"}} over runs (std: the sample std, 0 for one seed), for each key every run has."""
  return {key: {"mean": statistics.fmean(r[key] for r in runs),
                "std": statistics.stdev([r[key] for r in runs]) if len(runs) > 1 else 0.0, "seeds": len(runs)}
          for key in keys if all(key in r for r in runs)}


def main(argv=None) -> int:
  """`python experiments/sweep.py --help` prints what this library holds; it runs nothing itself."""
  parser = argparse.ArgumentParser(
      prog="experiments/sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="A library the runners import, nothing to run: python experiments/ablate_positions.py --help or "
             "python experiments/length_generalization.py --help.")
  parser.parse_args(argv)
  parser.error("a library the runners import, nothing to run: use experiments/ablate_positions.py or "
               "experiments/length_generalization.py")


if __name__ == "__main__":
  sys.exit(main())
