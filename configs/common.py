"""What every config shares, and the one parser for `get_config(arg)` variant strings.

A config file builds on `base_config()` and fills in `task` and `model`:

    def get_config(arg=None):
      args = common.parse_arg(arg, size="small", posenc="learned")
      config = common.base_config()
      config.task.name = "template"
      ...
      return config

`--config=configs/x.py:size=tiny,posenc=rope` passes "size=tiny,posenc=rope" as `arg`.
"""
from __future__ import annotations

from ml_collections import ConfigDict

from xattn_jax.training import optim

# Logical axis name -> mesh axes ("" = replicated, "a,b" = sharded over both). Layers annotate their
# parameters with these names; `xattn_jax.training.sharding` applies the rules.
DEFAULT_SHARDING_RULES = {
    "batch": "data,fsdp",
    "embed": "fsdp",
    "heads": "tensor",
    "kv": "",
    "mlp": "tensor",
    "vocab": "tensor",
    "length": "",
    "layers": "",
}


def parse_arg(arg: str | None, **defaults) -> ConfigDict:
  """Parses "key=value,flag,..." into a ConfigDict over `defaults`.

  Each value is converted to the type of its default (bool accepts true/false/1/0/yes/no); a bare
  `flag` sets a bool default to True. An unknown key raises a ValueError listing the known ones, so
  a misspelt variant fails as loudly as a misspelt `--config.x` override; so does a key given twice.
  """
  result = ConfigDict(dict(defaults))
  seen = set()
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    key, has_value, value = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"config argument {key!r} in {arg!r}: allowed keys are {sorted(defaults)}")
    if key in seen:
      raise ValueError(f"config argument {key!r} in {arg!r} is given twice")
    seen.add(key)
    default = defaults[key]
    if not has_value:
      if not isinstance(default, bool):
        raise ValueError(f"config argument {key!r} in {arg!r} needs a value ({key}=...)")
      result[key] = True
    elif isinstance(default, bool):
      lowered = value.strip().lower()
      if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"config argument {key}={value!r}: expected a boolean (true/false)")
      result[key] = lowered in ("true", "1", "yes")
    else:
      try:
        result[key] = type(default)(value.strip())
      except ValueError:
        raise ValueError(
            f"config argument {key}={value!r}: expected {type(default).__name__}") from None
  return result


def base_config(*, total_steps: int = 1000, batch_size: int = 32, eval_batch_size: int = 64,
                log_every_steps: int = 50, eval_every_steps: int = 500, checkpoint_every_steps: int = 500,
                learning_rate: float = 1e-3, warmup_steps: int = 100) -> ConfigDict:
  """Defaults every job shares: loop lengths, optimizer, logging, checkpoints, mesh, precision.

  The keyword arguments are the settings jobs most often change, so a config file sets its loop
  in one call instead of repeating the same assignments.
  """
  config = ConfigDict()
  config.seed = 0
  config.total_steps = total_steps
  # A budget sized by the data: with max_epochs > 0 training ends after that many passes over the training
  # data (a task that counts them: Task.steps_per_epoch) when that comes before total_steps, but not before
  # min_steps (nor after total_steps). For data the user brings, whose size no default can know.
  config.max_epochs = 0.0
  config.min_steps = 0
  config.batch_size = batch_size            # global: summed over every process and device
  config.eval_batch_size = eval_batch_size  # global; eval examples are padded up with weight-0 rows
  # Optimizer steps per jitted call: a loop over that many batches inside one program, with the same
  # updates and keys as one step per call (losses equal, at most up to float rounding). On CPU it
  # saves XLA's per-call allocation and page-faulting of the step's temporaries (the benchmark's
  # d_model-512, 3+3-layer translator: ~6-10% a step). Evals, checkpoints, the last step and a change
  # of batch shape end a call; SIGTERM / Ctrl-C stop at the end of a call.
  config.steps_per_call = 8
  # Gradient accumulation: each step's batch runs as this many equal microbatches in sequence (a lax.scan), their
  # loss sums, gradients and train metrics added, one update: the gradient of the whole batch at the memory of one
  # microbatch. Needs a task that gives its loss as (sum, weight) (Task.loss_terms: every bundled task; the VLM
  # without task.distill_weight).
  config.num_microbatches = 1
  # Resume order: a checkpoint in the workdir > `init_from` (parameters only) > from scratch.
  config.init_from = ""             # a checkpoint directory (workdir/checkpoints or one step in it)

  # Filled in by each job's config file.
  config.task = ConfigDict({"name": ""})
  config.model = ConfigDict({"name": ""})

  config.optimizer = ConfigDict({
      "name": "adamw",              # a name in xattn_jax.training.optim.OPTIMIZERS
      "learning_rate": learning_rate,  # peak, reached at the end of warmup
      "warmup_steps": warmup_steps,
      "schedule": "cosine",         # optim.SCHEDULES, after linear warmup
      # final_learning_rate_fraction, b1, b2, eps, momentum, weight_decay, weight_decay_exclude: the fields
      # only some optimizers or schedules read, with their defaults and what reads each
      **optim.CHOICE_FIELD_DEFAULTS,
      "grad_clip_norm": 1.0,        # global-norm clipping; 0 disables
  })

  config.log_every_steps = log_every_steps
  config.eval_every_steps = eval_every_steps
  config.logging = ConfigDict({"tensorboard": True, "plot": True})
  config.checkpoint = ConfigDict({
      "every_steps": checkpoint_every_steps,  # also saved at the end and on SIGTERM
      "keep": 2,                    # the last `keep` checkpoints ...
      "best_metric": "eval/loss",   # ... plus the best by this eval metric ("" = none; of equal values the first)
      "best_mode": "min",           # min | max
      # Which checkpoint --mode=eval / infer and loop.load_model read, and a run that freezes this one: latest |
      # best (by best_metric; with early stopping the latest is `patience` evals past it) | a kept step, e.g. "4000".
      "eval_from": "latest",
  })

  # patience > 0: training ends at the eval where checkpoint.best_metric has not beaten its best by more than
  # min_delta for `patience` evals in a row (a checkpoint is saved there and `early_stop.json` records it, so
  # the same command finds nothing to train and a run that depends on this one counts it finished).
  config.early_stopping = ConfigDict({"patience": 0, "min_delta": 0.0})

  # Mesh axis sizes; -1 takes the remaining devices (at most one axis may be -1).
  config.mesh = ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  # CPU devices launch.py gives a one-process run on the CPU backend (xattn_jax.training.distributed.set_cpu_devices).
  # XLA:CPU runs a small model's ops one after another on one core, and each device runs on its own, so N > 1
  # splits every batch over N cores through the mesh above; 0: one a core, as many as the mesh and the batch
  # sizes divide into. 1 leaves JAX's default (one device, or what JAX_NUM_CPU_DEVICES / XLA_FLAGS ask for).
  config.cpu_devices = 1
  config.sharding_rules = ConfigDict(DEFAULT_SHARDING_RULES)
  # param_dtype: float32 | bfloat16 (float16 parameters underflow Adam; no loss scaling here). bfloat16
  # parameters start as the float32 run's draws rounded and are the only copy (no float32 master weights):
  # the optimizer's moments are bfloat16 too, and an update under half a bfloat16 step of its weight
  # (about |w| / 256) rounds away. compute_dtype: float32 | bfloat16 | float16 (attention scores, softmax and
  # losses run in float32; logits come back float32).
  config.precision = ConfigDict({"param_dtype": "float32", "compute_dtype": "float32"})

  config.infer = ConfigDict({"input_file": "-"})  # "-" reads stdin; one input per line

  # num_steps > 0: trace the calls that run steps first_step + 1 ... first_step + num_steps (whole
  # calls) with jax.profiler into workdir/profile, with a table of where their time went
  # (xattn_jax/training/profiling.py). Skip the first call, which compiles: first_step >= steps_per_call.
  config.profile = ConfigDict({"first_step": 0, "num_steps": 0})

  # Test-only knobs: fault injection and slowing the loop down (a sleep after each call) so a signal
  # can land mid-run.
  config.debug = ConfigDict({"nan_at_step": -1, "step_delay_s": 0.0})
  return config
