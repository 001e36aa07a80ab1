"""The config record of a run's workdir: config.json / config.txt / config.py, what a new config
changes from it, the results of later evals (eval_results.jsonl), and the lock a training process holds.

`config.py` loads back as a config file (`--config=<workdir>/config.py`), so a run can be resumed,
evaluated or loaded (`inference.load_model`) with exactly the config it was made with; it imports the modules that
registered the entries of the package's registries it names (`registry.named_by`), as the run's config file did.

Every JSON record the engine and tasks read back from a workdir goes through `records.read_record`
(`read_rows` for a JSON-lines log): a damaged one is a DataError in one line (file:line:column, what to do).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket

from absl import logging
from ml_collections import ConfigDict

from xattn_jax import registry
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import records
from xattn_jax.training import task as task_lib
from xattn_jax.training import validation
from xattn_jax.training.errors import RunError


RECORD_FILES = ("config.json", "config.txt", "config.py")

# The fields naming a file or folder, as typed relative to the directory a run starts in, beside the
# workdir fields of the task's dependencies. A run records them absolute (`absolute_paths`), so that its
# config.py works from any directory; "" (unset) and "-" (standard input) are no paths.
PATH_FIELDS = ("data.train_file", "data.eval_file", "init_from", "infer.input_file")


# The data files a run trains on: their contents are recorded when it starts (DATA_RECORD), so that a run that
# declares it as a dependency does not load it after the file was edited in place.
DATA_FIELDS = ("data.train_file", "data.eval_file")
DATA_RECORD = "data_files.json"
DATA_REMEDY = ("restore it from a backup, or move it aside: the run then checks no data file against the "
               "contents it started on")


def _digest(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def record_data_files(config, workdir: str) -> None:
  """Writes DATA_RECORD: each DATA_FIELDS file of `config` (a regular file) as {field: {path, bytes, sha256}}."""
  record = {}
  for field in DATA_FIELDS:
    path = _field(config, field)
    if isinstance(path, str) and os.path.isfile(path):
      record[field] = {"path": _absolute(path), "bytes": os.path.getsize(path), "sha256": _digest(path)}
  records.write_atomically(os.path.join(workdir, DATA_RECORD), json.dumps(record, indent=2))


def _data_record(workdir: str) -> dict:
  """DATA_RECORD of the run in `workdir`: {field: {path, bytes, sha256}}; {} without one (a run from before it)."""
  return records.read_record(os.path.join(workdir, DATA_RECORD), DATA_REMEDY) or {}


def changed_data_files(config, workdir: str) -> list[str]:
  """The DATA_FIELDS whose file `config` names as the run in `workdir` recorded it (DATA_RECORD) but whose
  contents differ now, each as "field path (what changed)"; [] without a record (a run from before it)."""
  changed = []
  for field, was in _data_record(workdir).items():
    now = _field(config, field)
    if not (isinstance(now, str) and _absolute(now) == was["path"] and os.path.isfile(now)):
      continue  # another file (the config check names it) or gone (reading it will)
    size = os.path.getsize(now)
    if size != was["bytes"] or _digest(now) != was["sha256"]:
      changed.append(f"{field} {now} ({was['bytes']:,} bytes then, {size:,} now)" if size != was["bytes"]
                     else f"{field} {now} (same size, other contents)")
  return changed


def moved_data_files(config, workdir: str) -> dict[str, str]:
  """{field: new path} for the DATA_FIELDS whose file `config` names at another path than the run in `workdir`
  recorded (DATA_RECORD) but with the contents recorded: the run and its files copied or moved elsewhere. {}
  without a record."""
  moved = {}
  for field, was in _data_record(workdir).items():
    now = _field(config, field)
    if (isinstance(now, str) and now not in ("", "-") and _absolute(now) != was["path"] and os.path.isfile(now)
        and os.path.getsize(now) == was["bytes"] and _digest(now) == was["sha256"]):
      moved[field] = _absolute(now)
  return moved


def record_moved_data_files(config, workdir: str) -> dict[str, str]:
  """Writes the new paths of `moved_data_files` into DATA_RECORD (the contents recorded stay) and returns them,
  so that a run depending on this one checks the files where they are now."""
  moved = moved_data_files(config, workdir)
  if moved:
    record = _data_record(workdir)
    for field, now in moved.items():
      record[field]["path"] = now
    records.write_atomically(os.path.join(workdir, DATA_RECORD), json.dumps(record, indent=2))
  return moved


def path_fields(config, workdir: str | None) -> tuple[str, ...]:
  """The fields of `config` that name a file or folder: PATH_FIELDS it has and its dependencies' workdir fields."""
  task_class = task_lib.get_task_class(config.task.name)
  fields = PATH_FIELDS + tuple(dependency.workdir_field for dependency in task_class.dependencies(config, workdir))
  return tuple(field for field in dict.fromkeys(fields) if isinstance(_field(config, field), str))


def _field(config, field: str):
  try:
    return validation.get_field(config, field)
  except (KeyError, AttributeError, TypeError):  # a field this config does not have
    return None


def _absolute(value):
  return os.path.abspath(os.path.expanduser(value)) if isinstance(value, str) and value not in ("", "-") else value


def expand_home(config) -> None:
  """`~` in `config`'s PATH_FIELDS expanded, in place: the shell leaves it after `=` as it is, and validation checks
  the files before `absolute_paths` (which needs the task) runs."""
  for field in PATH_FIELDS:
    value = _field(config, field)
    if isinstance(value, str) and value.startswith("~"):
      parent, _, key = field.rpartition(".")
      (validation.get_field(config, parent) if parent else config)[key] = os.path.expanduser(value)


def absolute_paths(config, workdir: str | None) -> None:
  """Makes `config`'s path fields (`path_fields`) absolute, relative to the current directory (`~` expanded),
  in place."""
  for field in path_fields(config, workdir):
    parent, _, key = field.rpartition(".")
    section = validation.get_field(config, parent) if parent else config
    section[key] = _absolute(section[key])


def write_config(config, workdir: str) -> None:
  """Writes the resolved `config` as `<workdir>/config.json`, `config.txt` and `config.py` (RECORD_FILES)."""
  contents = (config.to_json_best_effort(indent=2, sort_keys=True) + "\n", str(config),
              config_file_text(config, "The resolved config of this run; pass it back as --config=<this file>."))
  for name, content in zip(RECORD_FILES, contents):
    records.write_atomically(os.path.join(workdir, name), content)
  for field, function, name, module, folder in registry.named_by(flat(json.loads(config.to_json_best_effort()))):
    if folder is None:
      logging.warning("%s=%r was added by %s(%r) in %s, which no import by name runs: %s/config.py loads only in a "
                      "process that registers it first (register it at the top level of a module the config file "
                      "imports)", field, name, function, name, module, workdir)


def record_resumed_config(config, workdir: str, step: int) -> dict[str, tuple]:
  """Records `config` for a run that trains on from checkpoint `step`; returns the fields that differ from its
  record (`config_differences`). Where any do, the record as it was is kept beside it as
  `<name>.before_step_<step>` (the first such copy, which holds the settings the steps up to `step` ran with):
  the record alone would claim this config for every step of the run."""
  changed = config_differences(config, workdir)
  if changed:
    for name in RECORD_FILES:
      path = os.path.join(workdir, name)
      if os.path.exists(path) and not os.path.exists(f"{path}.before_step_{step}"):
        shutil.copyfile(path, f"{path}.before_step_{step}")
  write_config(config, workdir)
  return changed


# What a run writes beside its record: a folder holding these but no run's record is someone else's.
OUTPUT_FILES = ("metrics.jsonl", "loss.png", "eval_results.jsonl", "tensorboard")


def foreign_record_files(workdir: str) -> list[str]:
  """The files among RECORD_FILES and OUTPUT_FILES in `workdir` that no run wrote (a folder of your own given as
  the workdir, a config.py or metrics.jsonl of yours in it): training there would overwrite them. [] where
  config.json is a run's record (it holds task and model sections). The caller asks only where no checkpoint is: a
  run's workdir there is one."""
  present = [name for name in RECORD_FILES + OUTPUT_FILES if os.path.exists(os.path.join(workdir, name))]
  try:
    record = recorded_config(workdir)
  except (OSError, ValueError):  # unreadable, or not JSON
    record = None
  is_run = isinstance(record, dict) and isinstance(record.get("task"), dict) and isinstance(record.get("model"), dict)
  return [] if is_run else present


# Held (flock) by the process that trains in the workdir; it ends with the process, however that ends.
LOCK_FILE = ".training.lock"


@contextlib.contextmanager
def training_lock(workdir: str):
  """Holds the workdir's training lock: a second process that trains there (the same command started twice, or
  started again while a run it left behind still trains) gets a RunError naming the holder, before it writes
  anything. Eval and infer take no lock. A file system without locks trains without one (a warning says so)."""
  handle = open(os.path.join(workdir, LOCK_FILE), "a+")
  try:
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
      if error.errno not in (errno.EAGAIN, errno.EACCES):
        logging.warning("%s: the file system takes no lock (%s); nothing keeps a second process from training "
                        "there at the same time", workdir, error.strerror)
      else:
        handle.seek(0)
        holder = handle.read().strip() or "a process"
        raise RunError(f"the workdir {workdir} is in use: {holder} trains there; wait for it to end or stop it "
                       "(SIGTERM saves a checkpoint), then start again") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    yield
  finally:
    handle.close()  # releases the lock


def config_file_text(config, docstring: str) -> str:
  """A config file (for --config) whose get_config() returns `config` as its JSON record holds it. Where the config
  names registry entries that code outside xattn_jax added (`registry.named_by`: another attention implementation,
  decoding method, position encoding, connector, optimizer), get_config() first imports the modules that registered
  them (`registry.restore`), as the config file that made the run did."""
  text = config.to_json_best_effort(sort_keys=True)
  added = registry.named_by(flat(json.loads(text)))
  if not added:
    return (f'"""{docstring}"""\n'
            "import json\n\nfrom ml_collections import ConfigDict\n\n"
            f"CONFIG = {text!r}\n\n\n"
            "def get_config(arg=None):\n  return ConfigDict(json.loads(CONFIG))\n")
  return (f'"""{docstring}"""\n'
          "import json\n\nfrom ml_collections import ConfigDict\n\nfrom xattn_jax import registry\n\n"
          f"CONFIG = {text!r}\n"
          "# (field, register function, entry, the module whose import registered it, the folder it imports from)\n"
          f"ADDED = {added!r}\n\n\n"
          "def get_config(arg=None):\n  registry.restore(ADDED)\n  return ConfigDict(json.loads(CONFIG))\n")


def flat(tree: dict, prefix: str = "") -> dict:
  """{"a.b.c": value} of a nested dict."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def stored_config(workdir: str) -> ConfigDict:
  """The config of the run in `workdir` (its config.json) as a ConfigDict: what a run that reads that one (a
  frozen part, an encoder) builds it from."""
  record = records.read_config(workdir)
  if record is None:
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.path.join(workdir, "config.json"))
  return ConfigDict(record)


def recorded_config(workdir: str) -> dict | None:
  """The config the run in `workdir` recorded (its config.json, as nested dicts), or None without one."""
  return records.read_config(workdir)


def config_differences(config, workdir: str) -> dict[str, tuple]:
  """{dotted field: (value in the run's config.json, value in `config`)} for every field where they
  differ, sorted by field (None for a field one side lacks); {} when the workdir holds no config.json."""
  recorded = recorded_config(workdir)
  return {} if recorded is None else _differences(flat(recorded), config, workdir)


def _differences(old: dict, config, workdir: str) -> dict[str, tuple]:
  """A path field differs where the paths, made absolute, do: a run recorded before paths were made absolute
  (or a config not launched) names the same file relative to the current directory."""
  new = flat(json.loads(config.to_json_best_effort()))
  paths = path_fields(config, workdir)
  same = lambda key: (_absolute(old.get(key)) == _absolute(new.get(key)) if key in paths
                      else old.get(key) == new.get(key))
  return {key: (old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if not same(key)}


# Fields that choose how the model computes, not what its parameters are or how they are stored: a resumed run,
# an eval or an infer may set them otherwise (another attention kernel, rematerialization to fit memory, the
# stacked layers scanned or unrolled: layers.layer_stack keeps the same parameters either way).
COMPUTE_FIELDS = ("model.implementation", "model.remat", "model.scan_layers")
# Fields that choose how the parameters are stored: a resumed run keeps them (eval and infer may read otherwise).
STORAGE_FIELDS = ("precision.param_dtype",)


def check_same_model(config, workdir: str, mode: str = "train") -> None:
  """Raises ConfigError when `config` changes the run already in `workdir`: training must keep its
  model, task and data sections (resuming on other data or another tokenizer is another experiment) but for
  COMPUTE_FIELDS, and the parameters' STORAGE_FIELDS;
  eval and infer must keep the model (but for the task's `eval_model_fields`; with its `model_building_fields`) and
  the tokenizer (they may decode differently, e.g. another task.decoding, and evaluate other files). Eval and infer take a
  dependency's frozen parameters from the run's own checkpoint and record, so the fields naming where
  training found them and how (the task's `Dependency.workdir_field`s and `config_field`s) may differ. An
  eval that names no data file where the run was trained on one is refused: it would score the bundled data
  instead. A field the run's record lacks (added to the code since) points to the run's own config.py."""
  if not checkpoints_lib.step_numbers(workdir):
    return  # no checkpoint yet (a run that failed before its first save): nothing to protect
  task_class = task_lib.get_task_class(config.task.name)
  unread = () if mode == "train" else {
      field for dependency in task_class.dependencies(config, workdir)
      for field in (dependency.workdir_field, dependency.config_field) if field} | set(
          task_class.eval_model_fields(config))

  data = config.get("data") or {}
  # an eval scoring the part the run held out of its training data must hold out the same part
  held_out = set(task_class.held_out_fields) if mode == "eval" and not data.get("eval_file") else set()

  def watched(field):
    if field in COMPUTE_FIELDS:
      return False
    if mode == "train":
      return True
    return ((field.startswith("model.") and field not in unread) or field in ("data.tokenizer", "data.vocab_size")
            or field in task_class.model_building_fields or field in held_out)

  raw = recorded_config(workdir)
  recorded = flat(raw or {})
  differences = {} if raw is None else _differences(recorded, config, workdir)
  for field in moved_data_files(config, workdir):  # the file the run read, at another path: the same data
    differences.pop(field, None)
  trained_on = differences.get("data.train_file", (None, None))[0]
  if mode == "eval" and trained_on and not data.get("train_file") and not data.get("eval_file"):
    # "" names the bundled data where a task has some: scoring it instead of the run's held-out text
    # would look like a result.
    raise validation.ConfigError("data.train_file", "", f"the run in {workdir} was trained on {trained_on!r} and "
                                 "this eval names no data file; name data.eval_file (or data.train_file, where the "
                                 "task scores the part it held out), or use "
                                 f"--config={os.path.join(workdir, 'config.py')}")
  scored_on = recorded.get("data.eval_file")
  if (mode == "eval" and held_out and scored_on and data.get("train_file")
      and "data.train_file" not in differences):
    # the run held nothing out of its training file: a held-out part of it now would be documents it trained on
    raise validation.ConfigError("data.eval_file", "", f"the run in {workdir} trained on every document of "
                                 f"data.train_file and was scored on {scored_on!r}: a part of the training file "
                                 "held out now would score documents it trained on; name data.eval_file, or use "
                                 f"--config={os.path.join(workdir, 'config.py')}")
  # The first difference reported: another task or model by name (a whole other kind of run: its
  # other fields differ too, and the alphabetically first of them would hide why), then by section.
  reported = [field for field in ("task.name", "model.name") if field in differences] + [
      field for section in ("model", "task", "data") for field in differences
      if field.startswith(section + ".") and watched(field)] + [
      field for field in STORAGE_FIELDS if field in differences and mode == "train"]
  if reported:
    field, (old, new) = reported[0], differences[reported[0]]
    if field not in recorded:
      # The run predates the field: its config.py reads it as the code of then did (a default the code keeps).
      raise validation.ConfigError(field, new, f"the run in {workdir} was made before this field existed; use its "
                                   f"own config, --config={os.path.join(workdir, 'config.py')}")
    if mode == "train":
      advice = "keep it, or use a new --workdir"
    elif field in held_out:
      advice = ("it chooses the held-out part this eval scores (another would hold training examples): keep it, or "
                "name data.eval_file")
    else:
      advice = f"{mode} reads the model as it was trained: keep it"
    raise validation.ConfigError(field, new, f"the run in {workdir} was made with {old!r}; {advice}")


# Fields (and sections) that only training reads: an eval's row does not list them as changed.
TRAINING_ONLY_FIELDS = ("batch_size", "total_steps", "max_epochs", "min_steps", "steps_per_call", "num_microbatches",
                        "log_every_steps", "eval_every_steps", "init_from", "optimizer.", "early_stopping.",
                        "checkpoint.every_steps", "checkpoint.keep", "logging.", "profile.", "debug.")


def append_eval_result(config, workdir: str, step: int, values: dict[str, float]) -> dict:
  """Appends `{"step", **values, "changed"}` to `<workdir>/eval_results.jsonl` and returns the row;
  `changed` holds the fields this eval's config changed from the run's (another data.grid,
  task.decoding ...), so a row evaluated with other settings says so; fields only training reads are left out."""
  training_only = lambda field: any(field == name or (name.endswith(".") and field.startswith(name))
                                    for name in TRAINING_ONLY_FIELDS)
  changed = {field: new for field, (_, new) in config_differences(config, workdir).items()
             if not training_only(field)}
  row = {"step": step, **values, "changed": changed}
  with open(os.path.join(workdir, "eval_results.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
  return row


def eval_figure_directory(workdir: str, step: int) -> str:
  """Where `--mode=eval` of checkpoint `step` draws its figures (`Task.figure_directory`):
  `<workdir>/eval_results/step_<step>`, named as its row of eval_results.jsonl, each family in the folder that
  training draws it in there. Training's evals draw in the workdir itself, and keep what they drew."""
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    raise ValueError(f"eval_figure_directory: step must be a checkpoint's step, an int >= 0, got {step!r}")
  return os.path.join(workdir, "eval_results", f"step_{step}")
