"""Resolving a task's declared dependencies: the runs its training needs finished first.

A task declares them with `Task.dependencies(config, workdir) -> list[Dependency]` (see
`xattn_jax.training.task`); `resolve(config, workdir, mode)` runs before `loop.run` (launch.py
calls it) and, for a train run, makes every one of them finished:

  1. every dependency whose workdir holds a run (a checkpoint) is checked first: that run must have
     been made with the declared config's model, task and data sections (the ones a resumed run may
     not change either), else a ConfigError names the first field that differs; nothing has trained;
  2. a finished run is left as it is (the task's constructor loads it);
  3. any other is trained, or resumed, there by `loop.run` with the declared config, after its own
     dependencies. When SIGTERM or Ctrl-C stops it (it saves a checkpoint), `DependencyStopped` ends
     the whole job with status 0, as a stopped run ends; the same command resumes it.

Eval and infer resolve nothing: the task reads what it took of its dependencies from its own workdir.
The engine knows no task or model by name: it reaches them through the task registry.
"""
from __future__ import annotations

import json
import os

from absl import logging
from ml_collections import ConfigDict

from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import loop, task as task_lib, validation

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The config sections that define a run: a dependency's run must agree with its declared config on them.
RUN_SECTIONS = ("task", "model", "data")


class DependencyStopped(SystemExit):
  """SIGTERM or Ctrl-C stopped a dependency's training, which saved a checkpoint: the job ends with
  status 0, as any stopped run does, and resumes the dependency when started again."""

  def __init__(self, message: str):
    super().__init__(0)
    self.message = message

  def __str__(self):
    return self.message


def load_config(spec: str, field: str) -> ConfigDict:
  """get_config(arg) of "path/to/config.py[:arg]", the path relative to the current directory or else to
  the repository; a missing or failing file is a ConfigError naming `field`."""
  path, _, arg = spec.partition(":")
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


def _flat(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
  return out


def check(dependency: task_lib.Dependency) -> None:
  """Raises ConfigError when the dependency's workdir holds a run (a checkpoint) made with another model,
  task or data config than the declared one, naming the first field that differs (task.name, model.name,
  then by section; the dependency's unchecked_fields aside)."""
  stored = os.path.join(dependency.workdir, "config.json")
  if not checkpoints_lib.step_numbers(dependency.workdir) or not os.path.isfile(stored):
    return  # no run there yet (or one that failed before its first save): nothing to protect
  with open(stored) as f:
    old = _flat(json.load(f))
  config = config_of(dependency)
  new = _flat(json.loads(config.to_json_best_effort()))
  differing = [key for key in sorted(set(old) | set(new)) if key.split(".")[0] in RUN_SECTIONS
               and key not in dependency.unchecked_fields and old.get(key) != new.get(key)]
  differing = [key for key in ("task.name", "model.name") if key in differing] + differing
  if differing:
    key = differing[0]
    field, value = ((dependency.config_field, dependency.config) if dependency.config_field
                    else (dependency.workdir_field, dependency.workdir))
    raise validation.ConfigError(
        field, value, f"its {key}={new.get(key)!r}, but the run in {dependency.workdir} "
        f"({dependency.workdir_field}) was made with {old.get(key)!r}; use a config that matches that run, "
        f"or another {dependency.workdir_field}")


def resolve(config, workdir: str | None, mode: str = "train", *, _chain: tuple[str, ...] = ()) -> list:
  """Makes every dependency that config's task declares finished (see the module docstring); returns them.

  Call it after `validation.validate_config(config)` and before `loop.run(config, workdir, mode)`.
  """
  if mode != "train":
    return []
  task_class = task_lib.get_task_class(config.task.name)
  dependencies = task_class.dependencies(config, workdir)
  for dependency in dependencies:
    if dependency.workdir in _chain or (workdir and dependency.workdir == os.path.abspath(workdir)):
      raise validation.ConfigError(dependency.workdir_field, dependency.workdir,
                                   "is the workdir of a run that depends on it: name another workdir")
    check(dependency)
  for dependency in dependencies:
    dependency_config = config_of(dependency)
    if is_finished(dependency):
      logging.info("Dependency %s: the run in %s is finished; loading it", dependency.workdir_field,
                   dependency.workdir)
      continue
    chain = _chain + ((os.path.abspath(workdir),) if workdir else ())
    resolve(dependency_config, dependency.workdir, "train", _chain=chain)
    logging.info("Dependency %s: training it first in %s", dependency.workdir_field, dependency.workdir)
    loop.run(dependency_config, dependency.workdir, "train")
    if not is_finished(dependency):  # the loop returns early only when stopped by a signal
      message = (f"The run in {dependency.workdir} ({dependency.workdir_field}) was stopped (SIGTERM or Ctrl-C) "
                 f"at step {max(checkpoints_lib.step_numbers(dependency.workdir), default=0)} of "
                 f"{dependency_config.total_steps} and saved; run the same command again to resume it, then "
                 "train the run that needs it")
      logging.warning("%s", message)
      raise DependencyStopped(message)
  return dependencies
