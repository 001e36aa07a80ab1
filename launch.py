"""python launch.py --config=configs/NAME.py[:ARG] --workdir=DIR [--mode=train|eval|infer] [--config.a.b=V]

Parses flags, validates the config (before any JAX computation), gives a CPU run its devices
(`config.cpu_devices`), starts multi-host JAX when asked, and hands over to `xattn_jax.training.loop.run`.
An invalid config or override prints one line on stderr naming the field and exits with status 2, as
does data the task cannot build (a corpus too small for its vocabulary); a diverged run exits with
status 1. Runs the task needs first (its dependencies) train before it, two or more missing ones side by
side (`--dependencies`); one that fails there ends the job with its exit status and last line.
"""
import os
import re
import sys

from absl import app, flags
from ml_collections import ConfigDict, config_flags

USAGE = ("python launch.py --config=configs/NAME.py[:ARG] --workdir=DIR [--mode=train|eval|infer] "
         "[--config.a.b=V]  (--helpfull lists every flag)")

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/NAME.py[:ARG]", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of the run: config, metrics, checkpoints.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval", "infer"], "What to do with the workdir.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "HOST:PORT of process 0 (multi-host).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Number of processes (multi-host).")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index (multi-host).")
_DEPENDENCIES = flags.DEFINE_enum(
    "dependencies", "side_by_side", ["side_by_side", "in_turn"],
    "How the runs a task needs first train when two or more are missing: side_by_side (each in a launch.py "
    "subprocess; one process on CPU only, else in turn) or in_turn (one after the other, in this process).")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None,
    "Directory of JAX's persistent compilation cache: an eval, an infer, a resumed run or a sweep's next cell reads "
    "the programs an earlier run compiled instead of compiling them again; '' turns it off. Default: "
    "$JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/xattn_jax/xla (~/.cache/xattn_jax/xla). Only programs "
    "that took JAX over a second to compile are kept (jax_persistent_cache_min_compile_time_secs); delete the "
    "folder to empty it.")
_DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout", 300, "Seconds a process waits for all processes to connect (multi-host); "
    "after that JAX aborts it.", lower_bound=1)


def fail(message: str, status: int = 2, *, at_once: bool = False):
  """Prints one line on stderr and exits with `status`; `at_once` skips the exit handlers too."""
  print(f"launch.py: {message}", file=sys.stderr, flush=True)
  if at_once:
    os._exit(status)
  sys.exit(status)


def parse_flags(argv):
  """absl parsing, with a bad flag, config file or override reported in one line (status 2)."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # flags.Error, and the raw AttributeError / KeyError of an unknown --config.key
    text = str(e).replace("\\n", "\n").strip()
    if "Traceback" in text:  # an error inside get_config(): its last line says what went wrong
      text = text.splitlines()[-1]
    # absl's bool parser raises a bare tuple: say what a boolean field takes
    text = re.sub(r"\('Non-boolean argument to boolean flag', (.*)\)", r"needs true or false (t / f, 1 / 0), got \1", text)
    if isinstance(e, (AttributeError, KeyError)):  # unknown --config.key: name the override
      key = text.splitlines()[0].strip("'\"\\ ")
      overrides = [a.split("=")[0] for a in argv
                   if a.startswith("--config.") and a.split("=")[0].rsplit(".", 1)[-1] == key]
      hint = " ".join(text.splitlines()[1:]).rstrip("'") or "the config has no such field"
      text = f"unknown config field {' '.join(overrides) or key}: {hint}"
    fail(" ".join(text.split()))


def compilation_cache(flag: str | None, environ) -> str:
  """The persistent compilation cache's directory: --compilation_cache when given ('' for none), else
  JAX_COMPILATION_CACHE_DIR as JAX reads it, else the user's cache folder."""
  if flag is not None:
    return os.path.abspath(os.path.expanduser(flag)) if flag else ""
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return environ["JAX_COMPILATION_CACHE_DIR"]
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "xattn_jax", "xla")


def use_compilation_cache(directory: str) -> None:
  """Points this process's JAX, and the launch.py subprocesses it starts (dependencies side by side), at the
  cache before anything compiles; '' turns it off. JAX_ENABLE_COMPILATION_CACHE=false still turns it off. A cache
  that cannot be written costs a warning, not the run (JAX's own handling)."""
  import jax
  if not directory:
    jax.config.update("jax_enable_compilation_cache", False)
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return
  jax.config.update("jax_compilation_cache_dir", directory)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = directory


def workdir_problem(workdir: str, mode: str) -> str | None:
  """Why `workdir` cannot hold a run (a file; a folder training cannot create or write; a run that eval cannot
  record its result in), or None."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    return "is a file, not a directory"
  if mode == "eval" and os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
    # Told before evaluating: the writes come after it (a run on read-only storage, a colleague's folder).
    return ("is not writable, and eval records its result there (eval_results.jsonl, plots): copy the run to a "
            "folder you can write, or use --mode=infer, which records no result")
  if mode != "train":
    return None  # eval / infer read a run there and say so when there is none
  existing = path
  while not os.path.exists(existing):  # the folder training would create it in
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"cannot be created: {existing} is a file"
  if not os.access(existing, os.W_OK | os.X_OK):
    return f"cannot be written: {existing} is not writable"
  return None


def config_error_line(error, workdir: str, mode: str, config_file: str = "") -> str:
  """The line for a ConfigError; for a data field refused in eval or infer of a run in `workdir`, a pointer to the
  run's own config, which names the files it was trained on (the bundled config names none), unless `config_file`
  (--config's) is that config already."""
  from xattn_jax.training import records, workdir as workdir_lib
  from xattn_jax.training.errors import DataError
  line = str(error)
  try:  # a damaged record only loses these hints here: training names it when it reads the record
    recorded = records.read_record(os.path.join(workdir, workdir_lib.DATA_RECORD), "")
  except DataError:
    recorded = None
  if getattr(error, "allowed", "") == "no such file":
    try:
      path = (recorded or {}).get(error.field, {}).get("path")
    except AttributeError:  # a hand-edited record whose entry is no object
      path = None
    if path and path == error.value:  # the run's own path: the run (or the file) was moved since
      return (f"{line} (the run in {workdir} read it there; if it moved, name it where it is now: "
              f"--config.{error.field}=PATH)")
  own = os.path.join(workdir, "config.py")
  if (mode != "train" and getattr(error, "field", "").startswith("data.") and os.path.isfile(own)
      and recorded != {}  # a run recorded as reading no files (the bundled digits) has none to point to
      and own not in line and os.path.abspath(os.path.expanduser(config_file)) != os.path.abspath(own)):
    line += f" (the run in {workdir} names its files in --config={own})"
  return line


def interrupted_line(workdir: str, mode: str) -> str:
  """The line for a KeyboardInterrupt: a second Ctrl-C in training (the first asked for a checkpoint), or a first
  one before training's loop takes Ctrl-C over (reading the data, compiling), or in eval or infer (nothing to save)."""
  from xattn_jax.training import checkpoints, guards
  press = "a second Ctrl-C" if guards.stop_requested() else "Ctrl-C"
  if mode != "train":
    return f"interrupted by {press}"
  steps = checkpoints.step_numbers(workdir)
  return (f"interrupted by {press}, without saving; last checkpoint: {'step ' + str(steps[-1]) if steps else 'none'} "
          "(a save it cut short is cleaned up on the next start)")


def main(argv):
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; usage: {USAGE}")
  if _CONFIG.value is None:
    fail(f"--config is required; usage: {USAGE}")
  if not isinstance(_CONFIG.value, ConfigDict):
    # ml_collections keeps a file that failed to load as a placeholder raising on first use.
    error = getattr(_CONFIG.value, "_error", None)
    reason = str(error).strip().splitlines()[-1].strip() if error else "get_config() returned no ConfigDict"
    fail(f"--config={flags.FLAGS['config'].serialize().split('=', 1)[-1]} cannot be loaded: {reason}")
  if not _WORKDIR.value:
    fail(f"--workdir is required; usage: {USAGE}")
  workdir = os.path.expanduser(_WORKDIR.value)  # the shell leaves `~` after `=` as it is
  problem = workdir_problem(workdir, _MODE.value)
  if problem:
    fail(f"--workdir={_WORKDIR.value}: {problem}")
  from xattn_jax.training import checkpoints, dependencies, distributed, loop, validation, workdir as workdir_lib
  use_compilation_cache(compilation_cache(_COMPILATION_CACHE.value, os.environ))
  dependencies.watch_launcher()  # a side-by-side dependency stops when the launcher that started it ends
  try:
    distributed.check_flags(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as e:
    fail(str(e))
  workdir_lib.expand_home(_CONFIG.value)  # as the workdir's
  try:
    validation.validate_config(_CONFIG.value, mode=_MODE.value, process_count=_NUM_PROCESSES.value,
                               workdir=workdir)
    distributed.set_cpu_devices(_CONFIG.value,  # before anything starts the backend
                                multi_process=_NUM_PROCESSES.value > 1 or distributed.cluster_detected())
    try:
      distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                             timeout_seconds=_DISTRIBUTED_TIMEOUT.value)
    except Exception as e:  # a bad host name, a port in use, mismatched process counts
      # At once: JAX's exit handler would wait at the shutdown barrier for peers of a group that cannot form.
      fail(f"multi-host start at --coordinator_address={_COORDINATOR.value} failed: "
           f"{type(e).__name__}: {' '.join(str(e).split())}", at_once=True)
    try:
      distributed.check_same_run(_CONFIG.value, workdir, _MODE.value, _DISTRIBUTED_TIMEOUT.value)
    except ValueError as e:  # all processes reach this verdict and stop together
      fail(str(e))
    dependencies.resolve(_CONFIG.value, workdir, _MODE.value,  # runs the task needs finished first
                         side_by_side=_DEPENDENCIES.value == "side_by_side")
    loop.run(_CONFIG.value, workdir, _MODE.value)
  except validation.ConfigError as e:
    fail(config_error_line(e, workdir, _MODE.value, flags.FLAGS["config"].config_filename))
  except (loop.DataError, checkpoints.CheckpointMismatch) as e:
    fail(str(e))
  except dependencies.DependencyFailed as e:  # its own lines, relayed, said why; this one names it
    fail(str(e), status=e.code)
  except (loop.TrainingDiverged, loop.RunError) as e:
    fail(f"{type(e).__name__}: {e}", status=1)
  except KeyboardInterrupt:  # one line, not the traceback of wherever it landed
    fail(interrupted_line(workdir, _MODE.value), status=130)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
