"""Resolving a task's declared dependencies: the runs its training needs finished first.

A task declares them with `Task.dependencies(config, workdir) -> list[Dependency]` (see
`xattn_jax.training.task`); `resolve(config, workdir, mode)` runs before `loop.run` (launch.py
calls it) and, for a train run, makes every one of them finished:

  1. every dependency whose workdir holds a run (a checkpoint) is checked first: that run must have
     been made with the declared config's model, task and data sections (the ones a resumed run may
     not change either), and its data files must hold what they held when it started (`DATA_RECORD`: a pairs
     file edited in place), else a ConfigError names the first field that differs; nothing has trained;
  2. a finished run is left as it is (the task's constructor loads it); a run its own recorded config ended
     (its total_steps, an early stop) that the declared config would train on is refused too, naming the
     run's own config.py (declared, it loads the run as it is) and the command that trains it on;
  3. any other is trained, or resumed, there by `loop.run` with the declared config, after its own
     dependencies. When SIGTERM or Ctrl-C stops it (it saves a checkpoint), `DependencyStopped` ends
     the whole job with status 0, as a stopped run ends; the same command resumes it.

With `side_by_side` (launch.py's default; used where `side_by_side_possible()`: one JAX process on CPU), two or
more missing dependencies train at once, each in its own `launch.py` subprocess with its declared config
(which resolves that run's own dependencies): their output is relayed with the workdir field as a prefix,
SIGTERM or Ctrl-C is passed on to each (each saves, and the job stops as above; a second Ctrl-C ends them
and the job without saving, status 130), a launcher that ends otherwise (SIGKILL) stops them too
(`watch_launcher`), and a subprocess that fails stops the others (they save) and ends the job with its exit
status and its last line (`DependencyFailed`).
The runs are the ones trained in turn would be: the same config and code in a process of their own.

Eval and infer resolve nothing: the task reads what it took of its dependencies from its own workdir.
The engine knows no task or model by name: it reaches them through the task registry.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import jax
from absl import logging
from ml_collections import ConfigDict

from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import guards, loop, task as task_lib, validation, workdir as workdir_lib

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAUNCH = os.path.join(_REPOSITORY, "launch.py")
# The config sections that define a run: a dependency's run must agree with its declared config on them.
RUN_SECTIONS = ("task", "model", "data")
# The workdirs of the runs waiting on a side-by-side subprocess's run (os.pathsep-joined), so that a cycle of
# dependencies is refused there as it is in one process.
CHAIN_VARIABLE = "XATTN_JAX_DEPENDENT_WORKDIRS"
# The process id of the launcher that started a side-by-side subprocess (`watch_launcher`).
LAUNCHER_VARIABLE = "XATTN_JAX_LAUNCHER_PID"


class DependencyStopped(SystemExit):
  """SIGTERM or Ctrl-C stopped a dependency's training, which saved a checkpoint: the job ends with
  status 0, as any stopped run does, and resumes the dependency when started again."""

  def __init__(self, message: str):
    super().__init__(0)
    self.message = message

  def __str__(self):
    return self.message


class DependencyFailed(SystemExit):
  """A dependency trained in a subprocess failed: the job ends with that subprocess's exit status."""

  def __init__(self, message: str, status: int):
    super().__init__(status)
    self.message = message

  def __str__(self):
    return self.message


def side_by_side_possible() -> bool:
  """Whether this process may train missing dependencies side by side as subprocesses: one JAX process
  (every process of a multi-host run trains them, in turn, together) on CPU (a GPU process claims most of the
  accelerator's memory for itself), with launch.py beside the package."""
  return jax.process_count() == 1 and jax.default_backend() == "cpu" and os.path.isfile(_LAUNCH)


def watch_launcher(interval_s: float = 1.0) -> None:
  """In a side-by-side subprocess (LAUNCHER_VARIABLE set): a daemon thread sends this process SIGTERM, so that
  its run saves and stops, once the launcher that started it has ended, however it ended (SIGKILL included): no
  run trains on unwatched, and a new start of the same command finds its workdir free (`workdir.training_lock`)
  within a call or two. Elsewhere it does nothing."""
  launcher = os.environ.pop(LAUNCHER_VARIABLE, "")  # for this process alone, not for what it starts
  if not launcher.isdigit():
    return

  def watch():
    while os.getppid() == int(launcher):
      time.sleep(interval_s)
    logging.warning("The launcher (process %s) that started this run has ended: stopping it with a checkpoint",
                    launcher)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=watch, name="watch_launcher", daemon=True).start()


def load_config(spec: str, field: str) -> ConfigDict:
  """get_config(arg) of "path/to/config.py[:arg]", the path relative to the current directory or else to
  the repository; a missing or failing file is a ConfigError naming `field`."""
  path, _, arg = validation.require_string(field, spec, "configs/lm_text.py:size=tiny").partition(":")
  if not os.path.isfile(path):
    path = os.path.join(_REPOSITORY, path)
  if not os.path.isfile(path):
    raise validation.ConfigError(field, spec, "no such config file")
  try:
    return validation.load_config_file(path, arg or None)
  except Exception as error:  # noqa: BLE001 - whatever the user's get_config raises, in one line
    raise validation.ConfigError(field, spec, f"cannot be loaded: {type(error).__name__}: "
                                 f"{' '.join(str(error).split())}") from None


def config_of(dependency: task_lib.Dependency) -> ConfigDict:
  """The dependency's config, loaded when it names a file."""
  if isinstance(dependency.config, str):
    return load_config(dependency.config, dependency.config_field or dependency.workdir_field)
  return dependency.config


def is_finished(dependency: task_lib.Dependency) -> bool:
  return dependency.finished(config_of(dependency), dependency.workdir)


def check(dependency: task_lib.Dependency) -> None:
  """Raises ConfigError when the dependency's workdir holds a run (a checkpoint) made with another model,
  task or data config than the declared one, naming the first field that differs (task.name, model.name,
  then by section; the dependency's unchecked_fields and workdir.COMPUTE_FIELDS aside)."""
  if not checkpoints_lib.step_numbers(dependency.workdir):
    return  # no run there yet (or one that failed before its first save): nothing to protect
  differences = workdir_lib.config_differences(config_of(dependency), dependency.workdir)  # {} without a record
  # COMPUTE_FIELDS (remat, scan, the attention kernel) leave the parameters as they are: a resumed run may set them
  # otherwise, so a frozen run trained with remat to fit memory is the run the declared config describes.
  differing = [key for key in differences if key.split(".")[0] in RUN_SECTIONS
               and key not in dependency.unchecked_fields and key not in workdir_lib.COMPUTE_FIELDS]
  differing = [key for key in ("task.name", "model.name") if key in differing] + differing
  field, value = ((dependency.config_field, dependency.config) if dependency.config_field
                  else (dependency.workdir_field, dependency.workdir))
  if differing:
    key = differing[0]
    old, new = differences[key]
    raise validation.ConfigError(
        field, value, f"its {key}={new!r}, but the run in {dependency.workdir} "
        f"({dependency.workdir_field}) was made with {old!r}; use a config that matches that run, "
        f"or another {dependency.workdir_field}")
  changed = workdir_lib.changed_data_files(config_of(dependency), dependency.workdir)
  if changed:  # the same path, edited since: loading or resuming that run would read other data than it trained on
    raise validation.ConfigError(
        field, value, f"the run in {dependency.workdir} ({dependency.workdir_field}) was trained on "
        f"{'; '.join(changed)}: the file changed since; train that run again in another {dependency.workdir_field}, "
        "or restore the file")
  ended = _ended_by_its_own_config(dependency.workdir)
  if ended and not is_finished(dependency):  # training it on would rewrite a run its own config finished
    declared = config_of(dependency).total_steps
    use = (f"name its config ({dependency.config_field}={os.path.join(dependency.workdir, 'config.py')})"
           if dependency.config_field else "declare its config (config.py in its workdir)")
    raise validation.ConfigError(
        field, value, f"the run in {dependency.workdir} ({dependency.workdir_field}) {ended}, where this "
        f"config trains it on to total_steps={declared}; to use that run as it is, {use}; to train it on, "
        f"resume it with launch.py --config={os.path.join(dependency.workdir, 'config.py')} "
        f"--workdir={dependency.workdir} --config.total_steps={declared}; or name another {dependency.workdir_field}")


def _ended_by_its_own_config(workdir: str) -> str | None:
  """How the run in workdir ended by its recorded config ('ended at its total_steps=N' or 'stopped early at
  step N'); None when it did not (or keeps no record to say)."""
  recorded = workdir_lib.recorded_config(workdir) or {}
  steps = checkpoints_lib.step_numbers(workdir)
  if os.path.isfile(os.path.join(workdir, task_lib.EARLY_STOP_FILE)):
    return f"stopped early at step {steps[-1]} (its {task_lib.EARLY_STOP_FILE})"
  if steps and steps[-1] == recorded.get("total_steps"):
    return f"ended at its own total_steps={steps[-1]}"
  return None


def _stopped_message(stopped) -> str:
  """One line for the dependencies (dependency, config) in `stopped` that a signal stopped unfinished."""
  def where(dependency, config):
    step = max(checkpoints_lib.step_numbers(dependency.workdir), default=0)
    end = task_lib.read_end_step(config, dependency.workdir) or config.total_steps  # max_epochs may end it early
    return f"saved at step {step} of {end}" if step else "stopped before its first checkpoint"

  runs = ", ".join(f"the run in {dependency.workdir} ({dependency.workdir_field}) {where(dependency, config)}"
                   for dependency, config in stopped)
  return (f"Stopped (SIGTERM or Ctrl-C): {runs}; run the same command again to resume "
          f"{'it' if len(stopped) == 1 else 'them'}, then train the run that needs "
          f"{'it' if len(stopped) == 1 else 'them'}")


def _stop_before_the_next_run(todo) -> None:
  """Raises DependencyStopped where a signal stopped a dependency in `todo` unfinished (only a signal ends one
  early), or asked this process to stop while they trained: one that came in a run's last call let it finish,
  and nothing queued after it may start."""
  stopped = [(dependency, config) for dependency, config in todo if not is_finished(dependency)]
  if not stopped and not guards.stop_requested():
    return
  if stopped:
    message = _stopped_message(stopped)
  else:
    message = (f"Stopped (SIGTERM or Ctrl-C) as {', '.join(d.workdir_field for d, _ in todo)} finished: run the "
               f"same command again to train the run that needs {'it' if len(todo) == 1 else 'them'}")
  logging.warning("%s", message)
  raise DependencyStopped(message)


def _relay(stream, prefix: str, last_line: list) -> None:
  """Copies a subprocess's output to stderr line by line behind `prefix`; keeps its last non-empty line."""
  for line in stream:
    sys.stderr.write(prefix + line)
    sys.stderr.flush()
    if line.strip():
      last_line[0] = line.strip()


def _train_side_by_side(todo, chain: tuple[str, ...]) -> None:
  """Trains every (dependency, config) of `todo` at once, each in a launch.py subprocess (module docstring)."""
  folder = tempfile.mkdtemp(prefix="xattn_jax_dependencies_")
  children, relays, last_lines = [], [], [[""] for _ in todo]
  signalled = set()  # the children this process asked to stop

  def stop(indices):
    for index in indices:
      if children[index].poll() is None:
        children[index].send_signal(signal.SIGTERM)  # the loop saves at the end of its current call
        signalled.add(index)

  interrupted = False

  def forward(signum, frame):
    nonlocal interrupted
    if signum == signal.SIGINT:
      if interrupted:  # a second Ctrl-C: a terminal's reaches the children too
        raise KeyboardInterrupt
      interrupted = True
    logging.warning("%s received: stopping the dependencies training side by side (each saves a checkpoint)",
                    signal.Signals(signum).name)
    guards.note_stop_request()
    stop(range(len(children)))

  previous = {}
  try:
    for signum in (signal.SIGTERM, signal.SIGINT):
      previous[signum] = signal.signal(signum, forward)
  except ValueError:  # not the main thread: signals reach only the process they are sent to
    previous.clear()
  failed = None
  try:
    for index, (dependency, dependency_config) in enumerate(todo):
      path = os.path.join(folder, f"dependency_{index}.py")
      with open(path, "w") as f:
        f.write(workdir_lib.config_file_text(dependency_config, f"The declared config of {dependency.workdir_field}."))
      prefix = f"[{dependency.workdir_field}] "
      logging.info("Dependency %s: training it in %s side by side with %d other run(s), in a subprocess whose "
                   "lines start with %r", dependency.workdir_field, dependency.workdir, len(todo) - 1, prefix)
      child = subprocess.Popen(
          [sys.executable, _LAUNCH, f"--config={path}", f"--workdir={dependency.workdir}"],
          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
          env={**os.environ, CHAIN_VARIABLE: os.pathsep.join(chain), LAUNCHER_VARIABLE: str(os.getpid()),
               "PYTHONUNBUFFERED": "1"})  # lines as written
      children.append(child)
      relays.append(threading.Thread(target=_relay, args=(child.stdout, prefix, last_lines[index]), daemon=True))
      relays[-1].start()
    while True:
      ended = all(child.poll() is not None for child in children)  # before the check: none ends unchecked
      for index, child in enumerate(children):
        if failed is None and index not in signalled and child.poll() not in (None, 0):
          failed = index  # the others stop and save: their work is kept for the next start
          stop(range(len(children)))
      if ended:
        break
      time.sleep(0.1)
  finally:
    stop(range(len(children)))  # only when this process itself fails or is interrupted: the children end with it
    for child in children:
      child.wait()
    for relay in relays:
      relay.join()
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    shutil.rmtree(folder, ignore_errors=True)
  if failed is not None:
    dependency, status = todo[failed][0], children[failed].returncode
    raise DependencyFailed(f"the training of {dependency.workdir_field} in {dependency.workdir} failed "
                           f"(exit status {status}): {last_lines[failed][0] or 'no output'}",
                           status if status > 0 else 1)
  _stop_before_the_next_run(todo)


def resolve(config, workdir: str | None, mode: str = "train", *, side_by_side: bool = False,
            _chain: tuple[str, ...] | None = None) -> list:
  """Makes every dependency that config's task declares finished (see the module docstring); returns them.

  Call it after `validation.validate_config(config)` and before `loop.run(config, workdir, mode)`.
  `side_by_side` asks for the subprocesses; they are used where `side_by_side_possible()`, else in turn.
  """
  if mode != "train":
    return []
  if _chain is None:  # this process's own call (in a side-by-side subprocess: the runs waiting on this one)
    _chain = tuple(filter(None, os.environ.get(CHAIN_VARIABLE, "").split(os.pathsep)))
    guards.clear_stop_request()  # what stops this process's queue from here on
  task_class = task_lib.get_task_class(config.task.name)
  dependencies = task_class.dependencies(config, workdir)
  for index, dependency in enumerate(dependencies):
    if not dependency.workdir.strip():  # os.path would read it as the current directory and train there
      raise validation.ConfigError(dependency.workdir_field, dependency.workdir,
                                   "must name the directory of the run this task needs first")
    if dependency.workdir in _chain or (workdir and dependency.workdir == os.path.abspath(workdir)):
      raise validation.ConfigError(dependency.workdir_field, dependency.workdir,
                                   "is the workdir of a run that depends on it: name another workdir")
    for other in dependencies[:index]:
      if other.workdir == dependency.workdir:
        raise validation.ConfigError(dependency.workdir_field, dependency.workdir,
                                     f"is {other.workdir_field} too: each run needs a workdir of its own")
    if workdir and checkpoints_lib.step_numbers(workdir) and not checkpoints_lib.step_numbers(dependency.workdir):
      # The run in workdir trained on this one, finished then: it was moved or deleted since (a workdir copied
      # elsewhere names it at its old path). Training a new one there would train what this run never read.
      where = (f"in {os.path.join(os.path.abspath(workdir), dependency.record)}" if dependency.record
               else "in its config")
      raise validation.ConfigError(
          dependency.workdir_field, dependency.workdir,
          f"holds no checkpoint, but the run in {workdir} froze the run there (moved or deleted?): eval and infer "
          f"need only {workdir}, whose checkpoints hold the frozen weights; to train it on, put that run back there"
          + (f" or write its new path as {dependency.workdir_field.rpartition('.')[2]} {where}" if dependency.record
             else ""))
    check(dependency)
  todo = []
  for dependency in dependencies:
    if is_finished(dependency):
      logging.info("Dependency %s: the run in %s is finished; loading it", dependency.workdir_field,
                   dependency.workdir)
    else:
      todo.append((dependency, config_of(dependency)))
  for dependency, dependency_config in todo:  # a bad config fails before anything trains, side by side or in turn
    try:
      validation.validate_config(dependency_config, mode="train", workdir=dependency.workdir)
    except validation.ConfigError as error:  # its fields are the dependency's, not this config's: say whose
      field = dependency.config_field or dependency.workdir_field
      value = dependency.config if dependency.config_field else dependency.workdir
      raise validation.ConfigError(field, value, f"the config of the run it names is invalid: {error}") from None
  chain = _chain + ((os.path.abspath(workdir),) if workdir else ())
  if side_by_side and len(todo) > 1 and side_by_side_possible():
    _train_side_by_side(todo, chain)
    return dependencies
  for dependency, dependency_config in todo:
    resolve(dependency_config, dependency.workdir, "train", side_by_side=side_by_side, _chain=chain)
    logging.info("Dependency %s: training it first in %s", dependency.workdir_field, dependency.workdir)
    loop.run(dependency_config, dependency.workdir, "train")
    _stop_before_the_next_run([(dependency, dependency_config)])
  return dependencies
