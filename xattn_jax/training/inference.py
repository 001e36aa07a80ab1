"""Inference on a trained run: input lines in, one answer line per input line out; and
`load_model`, the newest checkpoint of a run as (model, task) for notebooks and scripts.

Input is UTF-8 (a file, or "-" for stdin), checked as a data file is (`files.split_line_bytes`: UTF-16, NUL bytes
and bare carriage returns refused, a byte-order mark at a line's start dropped); lines end at \\n or \\r\\n only.
A blank input line is answered with a blank line (`Task.infer`: the task's `infer_lines` never sees it; a task
with `infers_blank_lines`, the language model, answers it: a sample from nothing), so output line i always
answers input line i (an answer's line breaks, which no bundled task generates, are written as spaces). A line
the task cannot take (`task.InputLineError`) or that is not UTF-8 is reported as `file:line: why` (a `DataError`).
"""
from __future__ import annotations

import os
import re
import sys

import jax
from absl import logging

from xattn_jax.data import files, tokenizers
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import task as task_lib, validation, workdir as workdir_lib
from xattn_jax.training.errors import DataError, RunError
from xattn_jax.training.trainer import Trainer

_LINE_BREAK = re.compile(f"[{tokenizers.LINE_BREAKS}]")
_MAX_REPORTED = 10  # bad input lines named in an error; the rest are counted


def read_input_lines(input_file: str) -> tuple[str, list[str]]:
  """(name for messages, lines) of an inference input: a UTF-8 file, or "-" for stdin."""
  name = "<stdin>" if input_file == "-" else input_file
  if input_file == "-":
    if sys.stdin.isatty():  # `--mode=infer` typed without an input: it waited in silence
      print("Reading input lines from the terminal: end them with Ctrl-D (or pipe a file in, or name one with "
            "--config.infer.input_file)", file=sys.stderr, flush=True)
    raw = sys.stdin.buffer.read()
  else:
    with open(input_file, "rb") as f:
      raw = f.read()
  # Lines end at \n (\r\n too), not at U+2028, \x0c, \x85 ... as str.splitlines would have it; checked as a
  # data file's are (UTF-16 without a byte-order mark read as text gave more answer lines than input lines).
  raw_lines = files.split_line_bytes(raw, name, _input_error)
  if raw_lines[-1] == b"":
    raw_lines.pop()
  lines = []
  for number, line in enumerate(raw_lines, 1):
    try:
      lines.append(line.decode("utf-8"))
    except UnicodeDecodeError as error:
      raise DataError(f"{name}:{number}: not valid UTF-8 at byte {error.start + 1} of the line") from None
  return name, lines


def _input_error(name: str, problems: list[tuple[int | None, str]],
                 what: str = "problems in the input") -> DataError:
  """The DataError "`name`[:line]: why" of (1-based line number or None, why) problems, a line each (the first
  _MAX_REPORTED, under a heading counting them where there are several): an input that `files.split_line_bytes`
  refuses, or input lines the task cannot take."""
  shown = [f"{name}:{number}: {why}" if number is not None else f"{name}: {why}"
           for number, why in problems[:_MAX_REPORTED]]
  if len(problems) > 1:
    more = len(problems) - len(shown)
    shown = [f"{name}: {len(problems)} {what}:", *(f"  {line}" for line in shown),
             *([f"  ... and {more} more"] if more else [])]
  return DataError("\n".join(shown))


def answer_lines(infer, lines: list[str], name: str = "<input>") -> list[str]:
  """`infer(lines)` (a task's `infer` with its model bound: one answer per line, blank ones included), each
  answer on one line. An InputLineError from `infer` becomes a DataError "`name`:<line number>: why", a line for
  each bad input line (the first _MAX_REPORTED)."""
  try:
    answers = infer(lines)
  except task_lib.InputLineError as error:
    raise _input_error(name, [(index + 1, message) for index, message in error.problems],
                       "input lines the task cannot take") from None
  by_number = dict(enumerate(answers, 1))
  broken = [number for number, answer in by_number.items() if _LINE_BREAK.search(answer)]
  if broken:  # the bundled tasks never generate one (Tokenizer.never_generated_ids); a task of yours may
    shown = ", ".join(map(str, broken[:10])) + (" ..." if len(broken) > 10 else "")
    logging.warning("%s: the answers to lines %s hold line breaks; each is written as a space, so that output "
                    "line i answers input line i", name, shown)
    for number in broken:
      by_number[number] = _LINE_BREAK.sub(" ", by_number[number])
  return [by_number.get(number, "") for number in range(1, len(lines) + 1)]


def infer(trainer: Trainer, state, input_file: str, output=None) -> list[str]:
  """Answers every line of `input_file` with the task's inference on `state`'s model; process 0
  writes the answers to `output` (default stdout), one line each. Returns the answers."""
  name, lines = read_input_lines(input_file)
  trainer.task.input_directory = "" if input_file == "-" else os.path.dirname(os.path.abspath(input_file))
  model = trainer.model(state)
  outputs = answer_lines(lambda batch: trainer.task.infer(model, batch), lines, name)
  if jax.process_index() == 0:
    stream = output or sys.stdout
    for line in outputs:
      stream.write(line + "\n")
    stream.flush()
  return outputs


def load_model(workdir: str, mode: str = "infer", overrides: dict | None = None):
  """(model, task) of a run's newest checkpoint (or its best: overrides={"checkpoint.eval_from": "best"}), for
  notebooks and scripts:

      model, task = loop.load_model("workdirs/dates")
      task.infer(model, ["Sunday, November 29, 2026"])   # the task's own inference

  The run's resolved config (`<workdir>/config.py`) rebuilds the task in `mode`: "infer" reads the
  workdir's tokenizer, not the training data (the translator's and the LM's batches are then refused, a RunError
  naming the mode); "eval" reads the eval data too (the task's eval examples), and
  the figures `task.extra_eval` draws go where `--mode=eval`'s do (`workdir.eval_figure_directory`).
  `overrides` ({dotted field: value}) changes that config first, as `--config.a.b=V` does for
  `launch.py --mode=eval`, e.g. {"data.num_eval_examples": 2000}; a change to the model, or a value the field
  cannot take, is refused (ConfigError naming the field). A run trained on a mesh of more devices than this
  process has is read onto all of its devices (mesh data=-1, fsdp=1, tensor=1; logged), as a checkpoint restores
  onto any mesh; `overrides` may name another mesh. The model is `task.config`'s, restored in place.
  """
  if mode not in ("infer", "eval"):
    raise ValueError(f"load_model: mode must be 'infer' or 'eval', got mode={mode!r}")
  workdir = os.path.expanduser(workdir)
  path = os.path.join(workdir, "config.py")
  if not os.path.isfile(path):
    raise RunError(f"{workdir} holds no config.py: is it a run's workdir?")
  config = validation.load_config_file(path)
  for field, value in (overrides or {}).items():
    try:
      validation.get_field(config, field)
    except (KeyError, TypeError):
      raise validation.ConfigError(field, value, f"is not a field of the run's config ({path})") from None
    try:
      config.update_from_flattened_dict({field: value})
    except (TypeError, ValueError) as error:  # ml_collections keeps each field's type
      raise validation.ConfigError(field, value, " ".join(str(error).split())) from None
  if not any(field.startswith("mesh.") for field in overrides or {}):
    try:
      validation.mesh_shape(config.mesh, jax.device_count())
    except validation.ConfigError:
      logging.info("load_model: the run's mesh %s does not fit this process's %d device(s): reading it onto "
                   "all of them (mesh data=-1, fsdp=1, tensor=1)", dict(config.mesh), jax.device_count())
      config.mesh.update({axis: -1 if axis == "data" else 1 for axis in validation.MESH_AXES})
  validation.validate_config(config, mode=mode, device_count=jax.device_count(),
                             process_count=jax.process_count())
  if overrides:
    workdir_lib.check_same_model(config, workdir, mode)
  trainer = Trainer(config, workdir, mode)
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=config.checkpoint.keep,
                                            best_metric=config.checkpoint.best_metric,
                                            best_mode=config.checkpoint.best_mode, read_only=True)
  try:
    state, step = trainer.latest_state(checkpoints, "load" if mode == "infer" else mode)
  finally:
    checkpoints.close()
  if mode == "eval":  # figures task.extra_eval draws go where --mode=eval's do
    trainer.task.figure_directory = workdir_lib.eval_figure_directory(workdir, step)
  return trainer.model(state), trainer.task
