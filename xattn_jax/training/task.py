"""The task interface: what a job plugs into the training loop, and the registry of tasks by name.

A task owns everything problem-specific: its config checks, its model, its batches, its loss and
metrics, and what inference means. The loop (`xattn_jax.training.loop`) owns everything else:
optimizer, jit, sharding, checkpoints, logging. Data flows one way: config -> task -> model -> loop.

To add a task, copy `xattn_jax/tasks/template.py` (the smallest complete task, built from the real
layers), subclass `Task` and register it:

    from xattn_jax.training import task as task_lib

    @task_lib.register("translate")
    class TranslateTask(task_lib.Task):
      ...

and make sure its module is imported: either add `"translate": "xattn_jax.tasks.translate.task"`
to `TASK_MODULES` below (imported lazily, only when that name is asked for), or name the class
directly in config as `task.name = "some.module:TranslateTask"`.

The contract (all shapes are per process unless said otherwise; B = config.batch_size is global):

- `validate(config, mode)` (classmethod): raise `validation.ConfigError(field, value, allowed)` for
  any task field that is wrong, BEFORE anything is built. Check the data files this mode ("train",
  "eval" or "infer") reads exist here. No JAX calls.
- `dependencies(config, workdir) -> list[Dependency]` (classmethod): the other runs this task's
  TRAINING needs finished first, e.g. the encoder a Q-Former freezes. Default: none. Each `Dependency`
  names the run's workdir, the config it is trained with (a ConfigDict, or a config file
  "path.py[:arg]" as launch.py's --config takes it) and the config fields of this task that name them
  (for messages), plus what "finished" means (default: a checkpoint at the config's total_steps or
  later). `xattn_jax.training.dependencies.resolve(config, workdir, mode)`, which launch.py calls
  after validation and before `loop.run`, makes them finished: a workdir without a finished run is
  trained (or resumed) there with that config, one with a finished run is left as it is, and one
  whose run was made with another model, task or data config is refused (ConfigError naming the
  field) before anything trains. Eval and infer resolve nothing: a task must take whatever it needs of
  its dependencies into its own workdir (a record, its checkpoint) during training. No JAX calls.
- `__init__(config, workdir, mode)`: host-side setup (read data, train or load a tokenizer into the
  workdir; load the finished dependencies, never train them); `infer` should need no more than the
  workdir. Runs on every process.
- `make_model(rngs, *, dtype, param_dtype) -> nnx.Module`: parameters annotated with logical axis
  names (`nnx.with_partitioning`) from {"embed", "heads", "kv", "mlp", "vocab", "length", None};
  `dtype` is the compute dtype, `param_dtype` the storage dtype. `rngs` has a `params` stream (from
  config.seed) and a `dropout` stream: pass it to `nnx.Dropout` layers as is. Before each train step
  the loop reseeds every `dropout` stream of the model from (seed, step), so dropout needs no
  handling in the task and resume stays exact.
- `loaded_params() -> dict | None`: the parameters make_model sets from other runs (frozen parts), as
  a pure dict of those paths of the model's state; the trainer passes them to its jitted init as
  arguments rather than compiling them in as constants. Default: None.
- `steps_per_epoch() -> int | None`: train mode, the steps of one pass over the training data; with it
  `config.max_epochs` can end the run before total_steps (`schedule.end_step`). Default: None.
- `train_batch(step, *, process_index, process_count) -> dict[str, np.ndarray]`: rows
  `[p * B/P, (p+1) * B/P)` of the global batch number `step` (0-based), a pure function of
  (config.seed, step, process_index, process_count). The step IS the data position: resume is exact.
  Every array has the batch on axis 0.
- `loss(model, batch, *, rngs) -> (loss, aux)`: traced inside the jitted train step; `loss` a float32
  scalar (mean over the global batch), `aux` a dict of float32 scalars logged as `train/<name>`.
  `rngs` is an `nnx.Rngs` derived from (seed, step) for any randomness the task draws itself
  (`rngs.noise()`); the model's dropout streams are already reseeded for this step.
- `loss_terms(model, batch, *, rngs) -> (loss_sum, weight_sum, aux)`: optional; the loss as a float32 sum
  over the batch and the weight it is divided by (`loss` = sum / max(weight, 1)), and aux {name: (sum,
  weight)} as eval_metrics gives them, so that microbatches add up to the whole batch's loss, gradient and
  train/<name> exactly (config.num_microbatches; averaging their means would weight a microbatch of few
  tokens like one of many). A task that defines it says so with `sums_its_loss()`, and `loss` defaults to
  those sums over their weights.
- `eval_batches(*, process_index, process_count) -> Iterable[dict[str, np.ndarray]]`: this process's
  rows of each global eval batch (size config.eval_batch_size, same row split as train_batch); every
  eval example once, the last batch padded with rows whose weight is 0. Every process yields the same
  number of batches.
- `eval_metrics(model, batch) -> dict[str, (sum, weight)]`: traced; the loop sums both parts over
  all batches and logs `eval/<name>` = total sum / total weight.
- `derived_eval(metrics) -> dict[str, float]`: metrics that follow from the summed ones (`metrics`: name ->
  total sum / total weight, without the `eval/` prefix), e.g. perplexity = exp(loss), with no second pass
  over the eval data; logged as `eval/<name>`. Default: none.
- `extra_eval(model) -> dict[str, float]`: host-side metrics that need decoding (BLEU, exact match
  of generated text); logged as `eval/<name>`. Default: none. Figures it draws (attention maps) go under
  `self.figure_directory` (none where it is None), numbered ones at the paths `figure_family` gives, which removes
  those an earlier eval drew beyond this one's count.
- `infer_lines(model, lines: list[str]) -> list[str]`: one output line per input line, for a non-empty list
  of non-blank lines (`Task.infer`, what the launcher and a notebook call, answers an empty list and blank lines
  itself, unless the task sets `infers_blank_lines`); lines the task cannot take raise one `InputLineError` with
  their indices (`read_each(lines, read)` reads every line and names every bad one), which `infer` maps to the
  caller's lines and the launcher reports as the file name and line numbers;
  `self.line_number(index)` is that line's number among the caller's lines (for output names, sampling keys).
  A file path in a line is read through `self.input_path(path)`: relative to the input file's folder, as the
  paths in a pairs file are relative to that file (stdin: the current directory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
from typing import Any, Callable, ClassVar, Iterable, Sequence

import numpy as np

from xattn_jax.training import records
from xattn_jax.training.errors import RunError

_REGISTRY: dict[str, type["Task"]] = {}


_MAX_MESSAGE = 400  # characters of one bad line's message: a line of megabytes is not echoed whole


def _clipped(message: str) -> str:
  """`message`, its middle cut where it is longer than _MAX_MESSAGE (its end often says what is allowed); the cut
  one is no longer, so cutting again leaves it as it is."""
  if len(message) <= _MAX_MESSAGE:
    return message
  half = (_MAX_MESSAGE - 50) // 2  # 50: room for the note of what is left out
  return f"{message[:half]} ... [{len(message) - 2 * half:,} characters left out] ... {message[-half:]}"


class InputLineError(ValueError):
  """Inference inputs the task cannot take: `problems`, (index, message) for each, index its 0-based position in
  `infer`'s lines; `index` and `message` are the first's (each message cut to _MAX_MESSAGE characters)."""

  def __init__(self, index: int, message: str, *, more: Sequence[tuple[int, str]] = ()):
    self.problems = [(i, _clipped(m)) for i, m in ((index, message), *more)]
    index, message = self.problems[0]
    self.index, self.message = index, message
    super().__init__("; ".join(f"input line {i + 1}: {m}" for i, m in self.problems))

  @classmethod
  def of(cls, problems: Sequence[tuple[int, str]]) -> "InputLineError":
    """One error naming every (index, message) of `problems` (at least one)."""
    return cls(*problems[0], more=problems[1:])


def read_each(lines: Sequence[str], read: Callable[[int, str], Any]) -> list:
  """[read(index, line) for each line], every line read first: the ValueError, OSError or InputLineError of each
  line that fails are raised together, one InputLineError naming every bad line (a user mends the whole input in
  one go, not a line a run)."""
  values, problems = [], []
  for index, line in enumerate(lines):
    try:
      values.append(read(index, line))
    except InputLineError as error:
      problems += error.problems
    except (ValueError, OSError) as error:
      problems.append((index, str(error)))
  if problems:
    raise InputLineError.of(problems)
  return values


def figure_family(directory: str, prefix: str, count: int, suffix: str = ".png") -> list[str]:
  """The paths `<directory>/<prefix>K<suffix>`, K = 0 .. count - 1, of a family of figures an eval draws: the
  folder is made (where count > 0), and the family's files numbered count and above removed, those an earlier eval
  drew with a higher count (a setting lowered since, a run resumed or evaluated with fewer), which would otherwise
  pass for this eval's. Only names of exactly that form are removed (K written without leading zeros)."""
  if isinstance(count, bool) or not isinstance(count, int) or count < 0:
    raise ValueError(f"figure_family: count must be an int >= 0, got {count!r}")
  for name, value in (("prefix", prefix), ("suffix", suffix)):
    if os.sep in value or (os.altsep and os.altsep in value):
      raise ValueError(f"figure_family: {name} must be a file name's part, without {os.sep!r}, got {value!r}")
  family = re.compile(f"{re.escape(prefix)}(0|[1-9][0-9]*){re.escape(suffix)}")
  if os.path.isdir(directory):
    for name in os.listdir(directory):
      match, path = family.fullmatch(name), os.path.join(directory, name)
      if match and int(match.group(1)) >= count and os.path.isfile(path):
        with contextlib.suppress(FileNotFoundError):
          os.remove(path)
  if count:
    os.makedirs(directory, exist_ok=True)
  return [os.path.join(directory, f"{prefix}{k}{suffix}") for k in range(count)]


# Short names whose module is imported on first use (so importing this file stays cheap).
TASK_MODULES = {
    "algorithmic": "xattn_jax.tasks.algorithmic",
    "digits": "xattn_jax.tasks.digits.task",
    "lm": "xattn_jax.tasks.lm",
    "lm_algorithmic": "xattn_jax.tasks.lm",
    "segment": "xattn_jax.tasks.segment.task",
    "template": "xattn_jax.tasks.template",
    "translate": "xattn_jax.tasks.translate.task",
    "vlm_encoder": "xattn_jax.tasks.vlm.encoder",
    "vlm_pairs_encoder": "xattn_jax.tasks.vlm.pairs_encoder",
    "vlm": "xattn_jax.tasks.vlm.task",
}


# Where a run sized by config.max_epochs ends, with the budget that set it (written when its training starts).
END_STEP_FILE = "end_step.json"
_BUDGET_FIELDS = ("total_steps", "max_epochs", "min_steps")


def write_end_step(config, workdir: str, end_step: int) -> None:
  """Records where this run's training ends (`schedule.end_step`) under its config's step budget."""
  records.write_atomically(os.path.join(workdir, END_STEP_FILE), json.dumps(
      {"end_step": end_step, **{field: config.get(field) for field in _BUDGET_FIELDS}}) + "\n")


def read_end_step(config, workdir: str) -> int | None:
  """The end recorded in workdir for config's budget (total_steps, max_epochs, min_steps); None when the
  budget is total_steps alone, or when the run recorded none for this budget."""
  if not config.get("max_epochs", 0.0):
    return None
  record = _read_record(workdir, END_STEP_FILE)
  if record is None or any(record.get(field) != config.get(field) for field in _BUDGET_FIELDS):
    return None
  return record["end_step"]


def _read_record(workdir: str, name: str) -> dict | None:
  """The JSON record `name` in workdir (written whole: `records.write_atomically`); None when it is missing. A
  damaged one raises a DataError (`records.read_record`) saying what to do."""
  return records.read_record(os.path.join(workdir, name), _REMEDIES[name])


# Where a run with config.early_stopping stopped, and the settings that stopped it (written when it stops).
EARLY_STOP_FILE = "early_stop.json"
_REMEDIES = {
    END_STEP_FILE: "move it aside: training the run again (its own config.py) writes it anew",
    EARLY_STOP_FILE: ("restore it from a backup, or move it aside to train the run on from its last checkpoint, "
                      "past where early stopping ended it"),
}


def early_stopping_settings(config) -> dict | None:
  """What an early stop depends on: the watched metric, its direction, patience and min_delta; None when
  early stopping is off (or the config predates it)."""
  if not config.get("early_stopping") or not config.early_stopping.patience:
    return None
  return {"metric": config.checkpoint.best_metric, "mode": config.checkpoint.best_mode,
          "patience": config.early_stopping.patience, "min_delta": config.early_stopping.min_delta}


def write_early_stop(config, workdir: str, step: int, reason: str, best_step: int | None) -> None:
  """best_step: the best eval's step (`checkpoint.eval_from=best` reads it)."""
  records.write_atomically(os.path.join(workdir, EARLY_STOP_FILE), json.dumps(
      {"step": step, "best_step": best_step, "reason": reason, **early_stopping_settings(config)}) + "\n")


def clear_early_stop(workdir: str) -> None:
  """Removes the record of an early stop that the run trains on past (under other settings)."""
  path = os.path.join(workdir, EARLY_STOP_FILE)
  if os.path.exists(path):
    os.remove(path)


def read_early_stop(config, workdir: str) -> tuple[int, str] | None:
  """(step, reason) of the early stop recorded in workdir under config's early-stopping settings; None when
  early stopping is off, or the run recorded no stop under these settings (a larger patience trains on)."""
  settings = early_stopping_settings(config)
  record = None if settings is None else _read_record(workdir, EARLY_STOP_FILE)
  if record is None or any(record.get(field) != value for field, value in settings.items()):
    return None
  return record["step"], record["reason"]


def reached_total_steps(config, workdir: str) -> bool:
  """Whether the run in workdir saved a checkpoint at its last step: `config.total_steps`, the earlier end
  that `config.max_epochs` set (`read_end_step`), or where early stopping ended it (`read_early_stop`)."""
  from xattn_jax.training import checkpoints  # orbax: imported only when a dependency is asked about
  end, stop = read_end_step(config, workdir), read_early_stop(config, workdir)
  end = config.total_steps if end is None else end
  return max(checkpoints.step_numbers(workdir), default=-1) >= (end if stop is None else min(end, stop[0]))


@dataclasses.dataclass(frozen=True)
class Dependency:
  """A run that must be finished before a task trains (see `Task.dependencies`).

  Attributes:
    workdir: the run's workdir (made absolute; "" is refused when resolved).
    config: the config it is trained with: a ConfigDict, or "path/to/config.py[:arg]" (relative to
      the current directory, else to the repository), loaded as launch.py's --config loads it.
    workdir_field: the field of the dependent task's config that names `workdir`, for messages.
    config_field: the field that names `config` when it is a file, for messages ("" when it is not).
    finished: (config, workdir) -> whether the run there is finished; `config` is the loaded one.
    unchecked_fields: fields of `config` that do not change what the run trains (a file it only evaluates
      on): a run there that differs only in them is the run declared.
    record: the file in the dependent run's workdir that records `workdir` once it trained (read before
      `workdir_field`), for messages ("" when there is none).
  """
  workdir: str
  config: Any
  workdir_field: str
  config_field: str = ""
  finished: Callable[[Any, str], bool] = reached_total_steps
  unchecked_fields: tuple[str, ...] = ()
  record: str = ""

  def __post_init__(self):
    if self.workdir.strip():  # "" stays "" (not the current directory): dependencies.resolve refuses it
      object.__setattr__(self, "workdir", os.path.abspath(self.workdir))


class Task:
  """Base class of a task; see the module docstring for the contract."""

  name: ClassVar[str] = ""
  # The eval/<name> metrics the task logs, when it can say so before running: checkpoint.best_metric
  # is checked against them. Empty: checked only for the "eval/" prefix.
  eval_metric_names: ClassVar[tuple[str, ...]] = ()
  # True: a blank input line reaches infer as "" (a language model samples from nothing for it); False:
  # the engine answers it with a blank line.
  infers_blank_lines: ClassVar[bool] = False
  # The data fields that choose the part of the training data held out for eval: an eval that scores that part
  # (names no data.eval_file) must keep them, or it would score examples the run trained on.
  held_out_fields: ClassVar[tuple[str, ...]] = ()
  # The fields outside model.* that the model's parameters are built from (an image's side, a count of outputs):
  # eval and infer keep them as they keep the model, so that a changed one is named, not a parameter's shape.
  model_building_fields: ClassVar[tuple[str, ...]] = ()
  # While `infer` runs: the caller's 1-based numbers of the lines handed to `infer_lines` (`line_number`).
  _line_numbers: list[int] | None = None

  def __init__(self, config, workdir: str | None = None, mode: str = "train"):
    self.config = config
    self.workdir = workdir
    self.mode = mode  # "train", "eval" or "infer": what the run will ask of the task
    # Set by the loop once its mesh exists: the sharding of a batch's rows over the data axes. A task
    # that runs its own batched computations (decoding in extra_eval / infer) may split rows with it.
    self.rows_sharding = None
    # Set by the loop with it: where a decode step's logits [rows, vocab] lie (`sharding.logits_sharding`;
    # None: the vocabulary is not split). Decoding ranks beam / top-k candidates there.
    self.logits_sharding = None
    # Set by the engine's infer: the folder of the input file ("" for stdin: the current directory).
    self.input_directory = ""
    # Where extra_eval draws its figures (None: it draws none): the workdir while training; set by the engine's
    # eval to `workdir.eval_figure_directory` of the step it reads, so that training's figures stay as they were.
    self.figure_directory = workdir if mode == "train" else None

  @staticmethod
  def position_encodings() -> tuple[str, ...] | None:
    """The model.position_encoding values the task's model builds, read from the position registry when called
    (validation names them); None: any registered. A task may set a tuple instead (fixed when its class is made)."""
    return None

  @classmethod
  def validate(cls, config, mode: str = "train") -> None:
    """Raises validation.ConfigError for an invalid task-specific field (for `mode`)."""

  @classmethod
  def dependencies(cls, config, workdir: str | None) -> list[Dependency]:
    """The runs this task's training needs finished first (see the module docstring)."""
    return []

  @classmethod
  def eval_model_fields(cls, config) -> tuple[str, ...]:
    """The model.* fields eval and infer may set otherwise than training did (`config` is theirs): they change
    how the trained parameters are read, not the parameters (a language model's context at eval). Empty by
    default: eval and infer keep the model."""
    return ()

  def make_model(self, rngs, *, dtype, param_dtype):
    raise NotImplementedError

  def loaded_params(self) -> dict | None:
    """The parameters make_model takes from other runs (a frozen encoder, a frozen LM), as a pure dict nested
    like `nnx.to_pure_dict(nnx.state(model))` and holding only those paths; None (the default) when it takes
    none. The trainer hands them to its jitted init as arguments: closed over, they would be compiled into
    the program as constants, which costs compile time and memory that grow with the frozen model."""
    return None

  def steps_per_epoch(self) -> int | None:
    """Train mode: the steps of one pass over the training data at config.batch_size (1 when it is smaller
    than one batch), so that config.max_epochs can size the run; None (the default): the task does not count
    them, and max_epochs > 0 is refused."""
    return None

  def train_batch(self, step: int, *, process_index: int, process_count: int) -> dict[str, np.ndarray]:
    raise NotImplementedError

  def loss(self, model, batch, *, rngs) -> tuple[Any, dict[str, Any]]:
    """`loss_terms`' sum / max(weight, 1) and each aux sum / weight: a task without loss_terms defines loss."""
    loss_sum, weight_sum, aux = self.loss_terms(model, batch, rngs=rngs)
    return mean_terms(loss_sum, weight_sum, aux)

  def eval_batches(self, *, process_index: int, process_count: int) -> Iterable[dict[str, np.ndarray]]:
    raise NotImplementedError

  def eval_metrics(self, model, batch) -> dict[str, tuple[Any, Any]]:
    raise NotImplementedError

  def loss_terms(self, model, batch, *, rngs) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
    raise NotImplementedError

  @classmethod
  def sums_its_loss(cls) -> bool:
    """Whether the task defines `loss_terms` (config.num_microbatches > 1 needs it)."""
    return cls.loss_terms is not Task.loss_terms

  def derived_eval(self, metrics: dict[str, float]) -> dict[str, float]:
    return {}

  def extra_eval(self, model) -> dict[str, float]:
    return {}

  def infer(self, model, lines: Iterable[str]) -> list[str]:
    """One answer per line of `lines` (a list, or any iterable of str), in order: `infer_lines` answers the
    non-blank ones, a blank (or whitespace-only) line gets "" (a task with `infers_blank_lines` answers every
    line). InputLineError names the line's position in `lines`; ValueError for a str, a non-str line or a line
    holding a line break."""
    if isinstance(lines, (str, bytes)) or not isinstance(lines, Iterable):
      raise ValueError(f"lines: an iterable of input lines, got {type(lines).__name__}"
                       + (" (one line is [line])" if isinstance(lines, (str, bytes)) else ""))
    lines = list(lines)
    for index, line in enumerate(lines):
      if not isinstance(line, str):
        raise ValueError(f"lines[{index}]: a str, got {type(line).__name__}")
      if "\n" in line:  # its answer would be two output lines (a file's lines end at \n)
        raise ValueError(f"lines[{index}]: holds a line break; give each input line as its own item")
    asked = [index for index, line in enumerate(lines) if self.infers_blank_lines or line.strip()]
    if not asked:
      return [""] * len(lines)
    self._line_numbers = [index + 1 for index in asked]
    try:
      answers = self.infer_lines(model, [lines[index] for index in asked])
    except InputLineError as error:
      raise InputLineError.of([(asked[index], message) for index, message in error.problems]) from None
    finally:
      self._line_numbers = None
    if isinstance(answers, str) or len(answers) != len(asked) or not all(isinstance(a, str) for a in answers):
      got = (f"a {type(answers).__name__}" if isinstance(answers, str) or not hasattr(answers, "__len__") else
             f"{len(answers)} answers" + ("" if all(isinstance(a, str) for a in answers) else ", not all str"))
      raise RunError(f"{type(self).__name__}.infer_lines gave {got} for {len(asked)} lines: the Task contract asks "
                     f"for one str per line")
    by_index = dict(zip(asked, answers, strict=True))
    return [by_index.get(index, "") for index in range(len(lines))]

  def line_number(self, index: int) -> int:
    """The 1-based number, among the lines `infer` was given (blank ones counted), of `infer_lines`' line
    `index`: what names a line's outputs and keys its samples, whatever lines come before it."""
    return self._line_numbers[index] if self._line_numbers else index + 1

  def infer_lines(self, model, lines: list[str]) -> list[str]:
    raise NotImplementedError

  def input_path(self, path: str) -> str:
    """A file named in an infer line: relative to the input file's folder (see the module docstring)."""
    return os.path.join(self.input_directory, os.path.expanduser(path))


def check_reads_data(task: Task, method: str, modes: tuple[str, ...] = ("train", "eval")) -> None:
  """RunError unless `task` was built in one of `modes`: a task built for infer (`loop.load_model`'s default)
  reads no training or eval data, so its batches would fail deep inside the batching with no word of the mode."""
  if task.mode not in modes:
    raise RunError(f"{type(task).__name__}.{method}: needs the task built in mode {' or '.join(map(repr, modes))}, "
                   f"got mode={task.mode!r} (infer reads neither training nor eval data; "
                   f"loop.load_model(workdir, mode='eval') reads the eval data)")


def mean_terms(loss_sum, weight_sum, aux: dict) -> tuple[Any, dict[str, Any]]:
  """(loss, aux means) of `loss_terms`' sums: loss_sum / max(weight_sum, 1); each aux sum over its weight (0
  where the weight is 0)."""
  import jax.numpy as jnp  # traced only: importing this module stays cheap
  means = {name: jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), 0.0)
           for name, (total, weight) in aux.items()}
  return loss_sum / jnp.maximum(weight_sum, 1.0), means


def register(name: str):
  """Class decorator: makes a Task subclass available as `config.task.name = name`."""
  def wrap(cls):
    cls.name = name
    _REGISTRY[name] = cls
    return cls
  return wrap


def allowed_names() -> list[str]:
  return sorted(set(_REGISTRY) | set(TASK_MODULES))


def get_task_class(name: str) -> type[Task]:
  """The Task class for a registered short name or a "package.module:ClassName" path.

  Raises KeyError saying why: an unknown name (with the allowed names), a module that cannot be imported, or one
  without that Task subclass.
  """
  if name not in _REGISTRY and name in TASK_MODULES:
    try:
      importlib.import_module(TASK_MODULES[name])
    except ModuleNotFoundError as e:
      raise KeyError(f"task {name!r} needs {TASK_MODULES[name]}, which cannot be imported ({e})") from None
  if name in _REGISTRY:
    return _REGISTRY[name]
  if name in TASK_MODULES:  # imported, yet no class registered under the name TASK_MODULES gives it
    raise KeyError(f"{TASK_MODULES[name]} registers no task {name!r} (TASK_MODULES names it so): its @register(...) "
                   f"name must be the same; registered: {sorted(_REGISTRY)}")
  module_name, colon, class_name = name.partition(":")
  if not (colon and module_name and class_name):
    raise KeyError(f"allowed are {allowed_names()} or 'package.module:TaskClass'")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
      raise  # the user's module imports something missing: its own traceback says what
    raise KeyError(f"module {module_name!r} cannot be imported ({e}): put the folder that holds it on PYTHONPATH "
                   f"(launch.py's own folder is on it, the working directory is not)") from None
  cls = getattr(module, class_name, None)
  if not (isinstance(cls, type) and issubclass(cls, Task)):
    found = sorted(key for key, value in vars(module).items()
                   if isinstance(value, type) and issubclass(value, Task) and value.__module__ == module_name)
    raise KeyError(f"module {module_name!r} has no Task subclass {class_name!r}; its Task subclasses: {found}")
  return cls
