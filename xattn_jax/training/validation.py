"""Config checks that run before anything is compiled or allocated.

Every failure is a `ConfigError` whose one-line message names the config field, the value it got and
what is allowed; `launch.py` prints it to stderr and exits with status 2. The checks here cover what
every job shares; each task adds its own through `Task.validate(config)`, and the attention-shape
checks below run over `config.model` and every sub-dict of it (encoder / decoder / reader).
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Sequence

import jax
from ml_collections import ConfigDict

from xattn_jax.layers import layer_stack
from xattn_jax.layers import positions as position_layers
from xattn_jax.ops import attention as attention_ops
from xattn_jax.ops import positions as position_ops
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import optim, schedule
from xattn_jax.training import task as tasks_lib

# The choices of code elsewhere are read from the registry that implements them: optimizers and
# schedules (training.optim), remat policies (layers.layer_stack), position encodings and their
# rules (layers.positions), attention implementations (ops.attention), RoPE scalings (ops.positions).
MESH_AXES = ("data", "fsdp", "tensor")
DTYPES = ("float32", "bfloat16", "float16")  # compute dtypes
PARAM_DTYPES = ("float32", "bfloat16")       # float16 parameters underflow Adam (no loss scaling here)


class ConfigError(ValueError):
  """An invalid config field: `config.<field>=<value>: <what is allowed>`."""

  def __init__(self, field: str, value, allowed: str):
    super().__init__(f"config.{field}={value!r}: {allowed}")
    self.field = field
    self.value = value
    self.allowed = allowed


def get_field(config, field: str):
  """config's value at the dotted path `field` ("model.num_layers"); KeyError when a part is missing."""
  node = config
  for part in field.split("."):
    node = node[part]
  return node


# Which checkpoint an eval / infer run reads (config.checkpoint.eval_from), or a step number as a string.
EVAL_FROM = ("latest", "best")


def is_number(value) -> bool:
  """An int or float, not a bool (nor None, a string, ...): what a range check may compare."""
  return not isinstance(value, bool) and isinstance(value, (int, float))


def require_string(field: str, value, example: str = "") -> str:
  """value, where it is a string (a config file of yours may hold a number where a name or spec goes)."""
  if not isinstance(value, str):
    raise ConfigError(field, value, f"must be a string{', e.g. ' + repr(example) if example else ''}")
  return value


def require_non_negative_number(config, field: str, rule: str = "must be a non-negative number",
                                below: float = float("inf")):
  """A number in [0, below): a non-negative number, or with below=1 a fraction."""
  value = get_field(config, field)
  if not is_number(value) or not 0 <= value < below:
    raise ConfigError(field, value, rule)


def _absent_field(error: Exception) -> str | None:
  """The field a KeyError / AttributeError raised by a ConfigDict lookup names ('data' of "'data'"); None for one
  raised elsewhere (a bug, raised as it is)."""
  frame = error.__traceback__
  while frame.tb_next is not None:
    frame = frame.tb_next
  if ConfigDict.__module__.split(".")[0] not in frame.tb_frame.f_code.co_filename:
    return None
  names = re.findall(r"'([A-Za-z_][A-Za-z0-9_]*)'", str(error.args[0]) if error.args else "")
  return names[0] if names else None


def _fields_named(config, matches, prefix: str = "") -> list[str]:
  """The dotted paths of `config`'s leaves whose own key `matches`."""
  paths = []
  for key, value in config.items():
    if isinstance(value, ConfigDict):
      paths += _fields_named(value, matches, f"{prefix}{key}.")
    elif matches(key):
      paths.append(prefix + key)
  return paths


def require_positive(config, *fields: str, allow_zero: bool = False):
  for field in fields:
    value = get_field(config, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
      raise ConfigError(field, value, "must be a " + ("non-negative" if allow_zero else "positive")
                        + " integer")


def load_config_file(path: str, arg: str | None = None) -> ConfigDict:
  """get_config(arg) of a config file, as launch.py's --config=path[:arg] loads it."""
  spec = importlib.util.spec_from_file_location("_loaded_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def require_choice(config, field: str, allowed):
  value = get_field(config, field)
  if value not in allowed:
    raise ConfigError(field, value, f"allowed are {sorted(allowed)}")


def require_file(field: str, path: str, *, read_once: bool = False):
  """For tasks: a data file named by `field` must exist before training starts; a pipe or device only where the
  file is `read_once` (an infer input: `<(zcat prompts.gz)`)."""
  if not path:
    raise ConfigError(field, path, "is required: the path of a file")
  if os.path.isdir(path):
    raise ConfigError(field, path, "is a directory; name a file")
  if not os.path.exists(path):
    raise ConfigError(field, path, "no such file")
  if not (read_once or os.path.isfile(path)):  # <(zcat corpus.gz) is a pipe: a run reads its files more than once
    raise ConfigError(field, path, "is not a regular file (a pipe or a device); save the data to a file and name it")


def _check_mesh_sizes(mesh_config) -> dict[str, int]:
  sizes = {axis: mesh_config[axis] for axis in MESH_AXES}
  for axis, size in sizes.items():
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise ConfigError(f"mesh.{axis}", size, "must be a positive integer or -1 (the rest)")
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh.{free[1]}", -1, f"only one mesh axis may be -1, got {free}")
  return sizes


def mesh_shape(mesh_config, device_count: int) -> dict[str, int]:
  """Resolves -1 in the mesh sizes against the device count; raises ConfigError if they do not fit."""
  sizes = _check_mesh_sizes(mesh_config)
  free = [axis for axis, size in sizes.items() if size == -1]
  fixed = 1
  for size in sizes.values():
    fixed *= size if size != -1 else 1
  if free:
    if device_count % fixed:  # the axes set (mesh.tensor=3), not the one left to take the rest, are what to change
      others = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items() if size != -1)
      raise ConfigError(f"mesh.{free[0]}", -1,
                        f"the other axes ({others} = {fixed} devices) do not divide the {device_count} devices")
    sizes[free[0]] = device_count // fixed
  elif fixed != device_count:
    raise ConfigError("mesh", dict(sizes), f"needs {fixed} devices, but {device_count} are available (a "
                      f"checkpoint restores onto any mesh: e.g. --config.mesh.data=-1 --config.mesh.fsdp=1 "
                      f"--config.mesh.tensor=1 spreads the batch over the devices here)")
  return sizes


def check_sharding_rules(rules) -> None:
  """Raises ConfigError (field `sharding_rules.<name>`) where a rule of `rules` ({logical axis name: "mesh axes"})
  is no string of comma-separated MESH_AXES, each named at most once."""
  for name, axes in rules.items():
    require_string(f"sharding_rules.{name}", axes, "data,fsdp")
    named = [axis.strip() for axis in axes.split(",") if axis.strip()]
    for axis in named:
      if axis not in MESH_AXES:
        raise ConfigError(f"sharding_rules.{name}", axes,
                          f"comma-separated mesh axes from {list(MESH_AXES)}, or '' (replicated)")
      if named.count(axis) > 1:  # JAX refuses a PartitionSpec that maps one mesh axis to a dimension twice
        raise ConfigError(f"sharding_rules.{name}", axes, f"names mesh axis {axis!r} twice; each at most once")


def _batch_shards(config, sizes: dict[str, int]) -> tuple[int, str]:
  """(the shards a batch's rows split into on a mesh of axis `sizes`, those axes as messages name them). The rows
  lie over the mesh axes sharding_rules.batch names (sharding.batch_sharding); an axis not in MESH_AXES is refused
  with the rules."""
  rule = config.get("sharding_rules", {}).get("batch", "data,fsdp")
  axes = [axis.strip() for axis in rule.split(",") if axis.strip() in MESH_AXES] if isinstance(rule, str) else []
  shards = math.prod(sizes[axis] for axis in axes)
  return shards, f"mesh {' x '.join(axes)} = {shards}" + ("" if rule == "data,fsdp" else
                                                          f" (sharding_rules.batch={rule!r})")


def check_mesh(config, device_count: int, mode: str = "train") -> dict[str, int]:
  """The mesh's axis sizes on `device_count` devices; raises ConfigError where the mesh does not fit them or, to
  train, where the batch (and each microbatch) does not split evenly over its data x fsdp shards. Eval and infer
  read no training batch, and pad their own to a size the shards divide (`eval_batch_size_on_mesh`): a run
  trained on any mesh is evaluated on any other."""
  if mode not in ("train", "eval", "infer"):
    raise ValueError(f"check_mesh: mode must be 'train', 'eval' or 'infer', got mode={mode!r}")
  sizes = mesh_shape(config.mesh, device_count)
  if mode != "train":
    return sizes
  batch_shards, over = _batch_shards(config, sizes)
  for field in ("batch_size", "eval_batch_size"):
    if config[field] % batch_shards:
      raise ConfigError(field, config[field], f"must be divisible by {over}")
  microbatches = config.get("num_microbatches", 1)  # a run's config.py written before the field has none
  if microbatches > 1 and (config.batch_size // microbatches) % batch_shards:
    raise ConfigError("num_microbatches", microbatches, f"leaves microbatches of "
                      f"{config.batch_size // microbatches} rows, not divisible by {over}")
  return sizes


def eval_batch_size_on_mesh(config, device_count: int) -> int:
  """config.eval_batch_size rounded up to a multiple of the shards its rows split into on `device_count` devices:
  the eval batch size of an eval or infer run, whose mesh may be another than training's. The metrics stay the
  same (up to float rounding): the tasks fill an eval batch's spare rows with weight-0 rows, and the loop adds
  up (sum, weight) pairs over the batches."""
  if isinstance(device_count, bool) or not isinstance(device_count, int) or device_count < 1:
    raise ValueError(f"eval_batch_size_on_mesh: device_count must be a positive integer, got {device_count!r}")
  shards, _ = _batch_shards(config, mesh_shape(config.mesh, device_count))
  return -(-config.eval_batch_size // shards) * shards


def _check_randomized_positions(model_config, prefix: str, encoding: position_layers.PositionEncoding | None,
                                allowed: Sequence[str]):
  """randomized_positions_max: 0 (off) or a max_position for an encoding computed from sequence indices."""
  field = f"{prefix}.randomized_positions_max"
  value = model_config.randomized_positions_max
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ConfigError(field, value, "must be an integer >= 0 (0 = off; else positions are drawn from [0, value))")
  if value and (encoding is None or not encoding.randomizable):
    raise ConfigError(field, value, f"randomizes sequence positions: needs position_encoding in "
                      f"{[name for name in position_layers.names(randomizable=True) if name in allowed]}, this model has "
                      f"{model_config.get('position_encoding')!r}; leave it 0 otherwise")
  if value and "max_length" in model_config and value < model_config.max_length:
    raise ConfigError(field, value, f"must be >= {prefix}.max_length={model_config.max_length}, the longest "
                      "sequence the model sees (or 0 = off)")


def check_attention_dims(model_config, prefix: str = "model", position_encoding: str = "",
                         allowed_encodings: Sequence[str] | None = None):
  """d_model divisible by num_heads; a registered position encoding (one of `allowed_encodings`, the task's,
  where it names them) and its declared rules (rotary width multiple, mrope sections, randomized positions only
  where it applies).

  `position_encoding` is read from the section itself or inherited from the enclosing one, so an
  encoder-decoder's `model.position_encoding` applies to `model.encoder` and `model.decoder`.
  """
  fields = model_config.keys()
  allowed = sorted(allowed_encodings or position_layers.POSITION_ENCODINGS)
  if "position_encoding" in fields and model_config.position_encoding not in allowed:
    raise ConfigError(f"{prefix}.position_encoding", model_config.position_encoding, f"allowed are {allowed}")
  position_encoding = model_config.get("position_encoding", position_encoding)
  encoding = position_layers.POSITION_ENCODINGS.get(position_encoding)
  rotary = encoding.rotary_kind if encoding is not None else None
  if "randomized_positions_max" in fields:
    _check_randomized_positions(model_config, prefix, encoding, allowed)
  if "rope_scaling_factor" in fields and not (is_number(model_config.rope_scaling_factor)
                                              and model_config.rope_scaling_factor > 0):
    raise ConfigError(f"{prefix}.rope_scaling_factor", model_config.rope_scaling_factor, "must be > 0")
  if "rope_scaling_factor" in fields and model_config.rope_scaling_factor != 1.0 and not model_config.get(
      "rope_scaling"):  # the factor alone changes nothing, and an eval's row would record it as a change
    raise ConfigError(f"{prefix}.rope_scaling_factor", model_config.rope_scaling_factor,
                      f"scales nothing without {prefix}.rope_scaling (one of {[s for s in position_ops.ROPE_SCALINGS if s]})")
  if model_config.get("rope_scaling") and model_config.rope_scaling not in position_ops.ROPE_SCALINGS:
    raise ConfigError(f"{prefix}.rope_scaling", model_config.rope_scaling,
                      f"allowed are '' (none) or {[s for s in position_ops.ROPE_SCALINGS if s]}")
  if model_config.get("rope_scaling") and rotary is None:
    # Without a rotary encoding the scaling would be ignored: a length ablation would measure nothing.
    raise ConfigError(f"{prefix}.rope_scaling", model_config.rope_scaling,
                      f"scales rotary positions: needs position_encoding in "
                      f"{[name for name in position_layers.names(role='rotary') if name in allowed]}, this model has "
                      f"{position_encoding!r}; "
                      f"leave it '' otherwise")
  if "rotary_dim" in fields and not (isinstance(model_config.rotary_dim, int) and model_config.rotary_dim >= 0):
    raise ConfigError(f"{prefix}.rotary_dim", model_config.rotary_dim, "must be a positive integer, or 0 (= head_dim)")
  # Fields only some encodings read, as rope_scaling above: set for another, an ablation would measure nothing.
  if model_config.get("rotary_dim") and rotary is None:
    raise ConfigError(f"{prefix}.rotary_dim", model_config.rotary_dim,
                      f"rotates part of each head: needs position_encoding in "
                      f"{[name for name in position_layers.names(role='rotary') if name in allowed]}, this model has "
                      f"{position_encoding!r}; leave it 0 otherwise")
  if "mrope_sections" in fields and tuple(model_config.mrope_sections) and not (rotary and rotary.num_sections):
    sectioned = [name for name in position_layers.names(role="rotary")
                 if name in allowed and position_layers.POSITION_ENCODINGS[name].rotary_kind.num_sections]
    raise ConfigError(f"{prefix}.mrope_sections", tuple(model_config.mrope_sections),
                      f"splits M-RoPE's frequency pairs: needs position_encoding in {sectioned}, this model has "
                      f"{position_encoding!r}; leave it () otherwise")
  if model_config.get("randomized_positions_at_eval") and not model_config.get("randomized_positions_max"):
    raise ConfigError(f"{prefix}.randomized_positions_at_eval", True,
                      f"draws eval positions from [0, {prefix}.randomized_positions_max), which is 0 (off): set it, or "
                      "leave this False")
  if "d_model" in fields and "num_heads" in fields:
    d_model, num_heads = model_config.d_model, model_config.num_heads
    if not isinstance(d_model, int) or d_model < 1:
      raise ConfigError(f"{prefix}.d_model", d_model, "must be a positive integer")
    if not isinstance(num_heads, int) or num_heads < 1:
      raise ConfigError(f"{prefix}.num_heads", num_heads, "must be a positive integer")
    if d_model % num_heads:
      raise ConfigError(f"{prefix}.d_model", d_model,
                        f"must be divisible by {prefix}.num_heads={num_heads}")
    head_dim = model_config.get("head_dim", 0) or d_model // num_heads
    if rotary is not None:
      rotary_dim = model_config.get("rotary_dim", 0) or head_dim
      field = f"{prefix}.rotary_dim" if model_config.get("rotary_dim", 0) else f"{prefix}.d_model"
      if rotary_dim % rotary.multiple_of or rotary_dim > head_dim:
        raise ConfigError(field, model_config.get(field.rsplit(".", 1)[1]),
                          f"rotary dimension {rotary_dim} must be a multiple of {rotary.multiple_of} and at "
                          f"most head_dim={head_dim} ({position_encoding})")
      if rotary.num_sections and "mrope_sections" in fields:  # a section without the field: the default split,
        sections = tuple(model_config.mrope_sections)           # or a model that takes no M-RoPE (its task says)
        if not sections and 3 * (rotary_dim // 2) // 8 < 1:  # () = the default 2:3:3 split, an axis at least a pair
          raise ConfigError(f"{prefix}.mrope_sections", sections,
                            f"() splits rotary_dim / 2 = {rotary_dim // 2} frequency pairs 2:3:3 between (time, "
                            "height, width), which needs rotary_dim >= 6: name the sections, or use wider heads")
        if sections and (len(sections) != rotary.num_sections or sum(sections) != rotary_dim // 2
                         or min(sections) < 1):
          raise ConfigError(f"{prefix}.mrope_sections", sections,
                            f"needs {rotary.num_sections} positive sections (one per position axis) summing to "
                            f"rotary_dim / 2 = {rotary_dim // 2} frequency pairs")
  if "implementation" in fields:
    if model_config.implementation not in ("", *attention_ops.IMPLEMENTATIONS):
      raise ConfigError(f"{prefix}.implementation", model_config.implementation,
                        f"allowed are '' (the op's default choice) or {list(attention_ops.IMPLEMENTATIONS)}")
  if "remat" in fields:
    if model_config.remat not in layer_stack.REMAT_POLICIES:
      raise ConfigError(f"{prefix}.remat", model_config.remat, f"allowed are {list(layer_stack.REMAT_POLICIES)}")
  for key in fields:
    if isinstance(model_config[key], ConfigDict):
      check_attention_dims(model_config[key], f"{prefix}.{key}", position_encoding)


def check_profile_window(config, workdir: str | None):
  """The trace starts with the first call that begins at or after profile.first_step: a window inside the last call
  of a run that trains on from the checkpoint in `workdir` (or from scratch) would trace nothing."""
  if not config.get("profile", {}).get("num_steps") or config.get("data", {}).get("length_bucketing"):
    return  # batches of another length cut calls where the data says: more calls start than the schedule's
  start = max(checkpoints_lib.step_numbers(workdir), default=0) if workdir else 0
  if start >= config.total_steps:
    return
  last_start = schedule.last_call_start(config, start)
  if config.profile.first_step >= config.total_steps:  # where max_epochs ends the run (Trainer)
    raise ConfigError("profile.first_step", config.profile.first_step,
                      f"training ends at step {config.total_steps}, before it; use at most {last_start}")
  if config.profile.first_step > last_start:
    raise ConfigError("profile.first_step", config.profile.first_step,
                      f"no training call starts at or after it: the last one runs steps {last_start + 1}-"
                      f"{config.total_steps} (steps_per_call={schedule.steps_per_call(config)}); use at most "
                      f"{last_start}, or a smaller steps_per_call")


# optimizer field -> (test, what it must be); a field a config does not have is not checked.
_OPTIMIZER_NUMBERS = {
    "learning_rate": (lambda v: v > 0, "must be > 0"),
    "grad_clip_norm": (lambda v: v >= 0, "must be >= 0 (0 = no clipping)"),
    "weight_decay": (lambda v: v >= 0, "must be >= 0"),
    "b1": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "b2": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "momentum": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "eps": (lambda v: v > 0, "must be > 0"),
    "final_learning_rate_fraction": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
}


def _check_optimizer_numbers(optimizer):
  for name, (ok, rule) in _OPTIMIZER_NUMBERS.items():
    if name not in optimizer:
      continue
    value = optimizer[name]
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value)):
      raise ConfigError(f"optimizer.{name}", value, rule + " and finite")


# Probabilities any task's config may have; each is checked where the config has it.
_PROBABILITIES = ("task.label_smoothing", "model.dropout_rate", "model.attention_dropout_rate")


def _check_probabilities(config):
  for field in _PROBABILITIES:
    section, key = field.split(".")
    if key in config.get(section, {}):
      require_non_negative_number(config, field, "must be in [0, 1)", below=1.0)


def validate_config(config, *, mode: str = "train", device_count: int | None = None,
                    process_count: int = 1, workdir: str | None = None):
  """Checks the shared fields, then the model's attention shapes, then the task's own fields.

  With `device_count` (known only after jax.distributed.initialize) the mesh is checked too. With `workdir`, a
  training that resumes from its checkpoints there does not need the fields only a fresh one reads (init_from).
  """
  if mode not in ("train", "eval", "infer"):
    raise ConfigError("mode", mode, "allowed are ['eval', 'infer', 'train']")
  try:
    task_class = tasks_lib.get_task_class(require_string("task.name", config.task.name, "translate"))
  except KeyError as e:
    raise ConfigError("task.name", config.task.name, e.args[0]) from None
  require_positive(config, "total_steps", "batch_size", "eval_batch_size", "log_every_steps",
                   "eval_every_steps", "checkpoint.every_steps", "checkpoint.keep")
  if "steps_per_call" in config:  # a run's config.py written before the field existed has none
    require_positive(config, "steps_per_call")
  require_positive(config, "optimizer.warmup_steps", allow_zero=True)
  # Every seed (seed, data.split_seed, task.decoding.seed, ...): numpy's legacy seeding and sklearn take integers in
  # [0, 2**32) (sklearn's train_test_split raised its own InvalidParameterError from inside a task's check).
  for field in _fields_named(config, lambda key: key == "seed" or key.endswith("_seed")):
    seed = get_field(config, field)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
      raise ConfigError(field, seed, "must be a non-negative integer below 2**32 (numpy's and sklearn's seed range)")
  if "max_epochs" in config:  # a run's config.py written before the fields existed has neither
    require_non_negative_number(config, "max_epochs", "must be a non-negative number (0: total_steps alone)")
    require_positive(config, "min_steps", allow_zero=True)  # capped by total_steps, as every end is
  if "debug" in config:
    require_non_negative_number(config, "debug.step_delay_s", "must be a non-negative number of seconds")
    nan_at = config.debug.get("nan_at_step", -1)  # the loss of step nan_at_step is NaN; 0 or -5 matched no step
    if nan_at != -1 and not (is_number(nan_at) and nan_at == int(nan_at) and 1 <= nan_at <= config.total_steps):
      raise ConfigError("debug.nan_at_step", nan_at, f"-1 (off) or the step whose loss to make NaN, in [1, "
                        f"total_steps={config.total_steps}] (test-only fault injection)")
  if "profile" in config:  # a run's config.py written before the field existed has none
    require_positive(config, "profile.first_step", "profile.num_steps", allow_zero=True)
    if config.profile.num_steps and config.profile.first_step >= config.total_steps:
      raise ConfigError("profile.first_step", config.profile.first_step,
                        f"must be below total_steps ({config.total_steps}) to trace any step")
    if mode == "train":
      check_profile_window(config, workdir)
  require_choice(config, "optimizer.name", optim.OPTIMIZERS)
  require_choice(config, "optimizer.schedule", optim.SCHEDULES)
  _check_optimizer_numbers(config.optimizer)
  _check_probabilities(config)
  require_choice(config, "checkpoint.best_mode", ("min", "max"))
  if "eval_from" in config.checkpoint:  # a run's config.py written before the field existed has none
    eval_from = config.checkpoint.eval_from
    if eval_from not in EVAL_FROM and not (isinstance(eval_from, str) and eval_from.isdigit()):
      raise ConfigError("checkpoint.eval_from", eval_from, f"allowed are {list(EVAL_FROM)} or a kept checkpoint's "
                        f"step number (e.g. '4000')")
    kept = checkpoints_lib.step_numbers(workdir) if workdir and mode != "train" else []
    if eval_from.isdigit() and kept and int(eval_from) not in kept:  # none kept: eval / infer say there is no run
      raise ConfigError("checkpoint.eval_from", eval_from, f"no checkpoint at step {eval_from} in "
                        f"{os.path.join(workdir, 'checkpoints')}; it keeps steps {kept}, or read 'latest' or 'best'")
    if config.checkpoint.eval_from == "best" and not config.checkpoint.best_metric:
      raise ConfigError("checkpoint.eval_from", "best", "needs checkpoint.best_metric, which is '': name the eval "
                        "metric that ranks the checkpoints, or read the 'latest'")
  best = require_string("checkpoint.best_metric", config.checkpoint.best_metric, "eval/loss")
  if best and (not best.startswith("eval/")
               or (task_class.eval_metric_names and best not in task_class.eval_metric_names)):
    allowed = list(task_class.eval_metric_names) or "an eval/<name> metric the task logs"
    raise ConfigError("checkpoint.best_metric", best, f"allowed are '' (no best checkpoint) or {allowed}")
  if "early_stopping" in config:  # a run's config.py written before the field existed has none
    require_positive(config, "early_stopping.patience", allow_zero=True)
    require_non_negative_number(config, "early_stopping.min_delta")
    if config.early_stopping.patience and not best:
      raise ConfigError("early_stopping.patience", config.early_stopping.patience,
                        "compares checkpoint.best_metric, which is '': name the eval metric to watch there")
  if config.precision.param_dtype == "float16":
    # Adam's second moment (grad^2, kept in the parameters' dtype) underflows float16 to 0 and the
    # first update overflows: NaN at step 2. bfloat16 has float32's exponent range.
    raise ConfigError("precision.param_dtype", "float16",
                      f"allowed are {sorted(PARAM_DTYPES)}: float16 parameters and optimizer state underflow "
                      "(no loss scaling here); float16 is allowed as precision.compute_dtype")
  require_choice(config, "precision.param_dtype", PARAM_DTYPES)
  require_choice(config, "precision.compute_dtype", DTYPES)
  check_sharding_rules(config.sharding_rules)
  # Only a fresh training reads it: eval, infer and a training that resumes read the run's own checkpoints (which
  # hold what init_from gave it, and may outlive it).
  if mode == "train" and config.init_from and not (workdir and checkpoints_lib.step_numbers(workdir)):
    if not os.path.isdir(config.init_from):
      raise ConfigError("init_from", config.init_from, "no such checkpoint directory")
    if not checkpoints_lib.holds_checkpoint(config.init_from):  # a run's workdir, say: its steps are one folder down
      inside = os.path.join(config.init_from, "checkpoints")
      raise ConfigError("init_from", config.init_from, "holds no checkpoint: name a run's checkpoints directory or "
                        f"one step in it{', here ' + inside if checkpoints_lib.step_numbers(config.init_from) else ''}")
  if mode == "infer" and config.infer.input_file != "-":
    require_file("infer.input_file", config.infer.input_file, read_once=True)  # inference.read_input_lines
  if "cpu_devices" in config:  # a run's config.py written before the field existed has none
    require_positive(config, "cpu_devices", allow_zero=True)
  if mode == "train" and config.batch_size % process_count:  # eval and infer read no training batch
    raise ConfigError("batch_size", config.batch_size,
                      f"must be divisible by the number of processes ({process_count})")
  microbatches = config.get("num_microbatches", 1)  # a run's config.py written before the field has none
  if microbatches != 1:
    require_positive(config, "num_microbatches")
    if not task_class.sums_its_loss():
      raise ConfigError("num_microbatches", microbatches, f"needs a task whose loss is a sum and a weight "
                        f"(Task.loss_terms); task {config.task.name!r} gives only its mean: use 1")
    if config.batch_size % microbatches:
      raise ConfigError("num_microbatches", microbatches, f"must divide batch_size={config.batch_size}")
  # the backend is up where device_count is given (asking for it earlier would start it before
  # jax.distributed.initialize): a CPU run hears of the GPU first, not of the dtype cuDNN would need next
  if device_count is not None and config.model.get("implementation") == "cudnn" and jax.default_backend() != "gpu":
    raise ConfigError("model.implementation", "cudnn",
                      f"needs a GPU backend, this run has {jax.default_backend()!r}; use '' (the default choice)")
  if config.model.get("implementation") == "cudnn" and config.precision.compute_dtype not in ("bfloat16", "float16"):
    raise ConfigError("model.implementation", "cudnn",
                      f"needs precision.compute_dtype bfloat16 or float16, got {config.precision.compute_dtype!r}")
  if device_count is not None:
    try:
      check_mesh(config, device_count, mode)
    except ConfigError as error:  # devices the config itself asked for: say so, or the mesh looks to blame alone
      asked = config.get("cpu_devices", 1)
      if asked == device_count != 1:
        raise ConfigError(error.field, error.value, f"{error.allowed}; these {device_count} devices are the ones "
                          f"config.cpu_devices={asked} asks for") from None
      raise
  else:
    _check_mesh_sizes(config.mesh)
  allowed = task_class.position_encodings  # a task of yours may give a tuple, read once, instead of the method
  try:
    check_attention_dims(config.model, allowed_encodings=allowed() if callable(allowed) else allowed)
    task_class.validate(config, mode)
  except (KeyError, AttributeError) as error:  # a field the task reads is absent from this config
    missing = _absent_field(error)
    if missing is None:
      raise
    model = config.model.get("name", "") if "model" in config else ""
    raise ConfigError("task.name", config.task.name, (
        f"{'with model.name=' + repr(model) + ' ' if model else ''}reads a config field {missing!r} that this "
        "config lacks: it was written for another task or model; start from a config file of this one (configs/)"
    )) from None
