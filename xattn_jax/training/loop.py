"""`run(config, workdir, mode)`: train, evaluate or run inference for any registered task.

Where a train run starts (the resume order):
  1. the newest readable checkpoint in `<workdir>/checkpoints` (step, parameters, optimizer state,
     RNG key; the data position is the step itself, so the losses continue exactly);
  2. otherwise `config.init_from` (parameters only; step 0, a fresh optimizer);
  3. otherwise from scratch (parameters from `config.seed`).

Steps count completed updates: update number s (1-based) reads the task's train batch s - 1, and
checkpoint s holds the state after it. Metrics of step s are `metrics.jsonl` rows with "step": s.

One jitted call runs `config.steps_per_call` steps (`multi_step`: a loop over that many stacked
batches, the same updates as one step per call); a call is cut short so that every eval, checkpoint
and the last step end one, and where the batches change shape (length bucketing). Metrics still come
back per step.

A non-finite loss or gradient norm raises `TrainingDiverged` naming the step, before anything of
that step is saved. SIGTERM (or a first Ctrl-C) lets the calls already dispatched finish (JAX's
dispatch runs a few calls ahead), saves a checkpoint and returns normally.
With several processes every call also dispatches a vote (the OR of each process's SIGTERM flag,
one boolean per device), read after the next call has been dispatched: a signal that reaches one
host stops every host at the same step, one call later, where they save the checkpoint together,
and the vote never makes the host wait for the call it has just dispatched.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging as py_logging
import os
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import metrics as metrics_lib
from xattn_jax.training import optim, sharding, task as task_lib, validation


class TrainingDiverged(RuntimeError):
  """The loss or the gradient norm became NaN or infinite."""


class RunError(RuntimeError):
  """The run cannot proceed (e.g. nothing to evaluate); the message says why."""


class DataError(ValueError):
  """The task could not build its data or tokenizer from the configured files; the message says which."""


# Stream ids folded into the run's key, so the model's dropout masks and a task's own randomness
# never share keys.
_DROPOUT_STREAM, _TASK_STREAM = 0, 1


def model_rngs(seed: int) -> nnx.Rngs:
  """The Rngs a task's make_model receives: `params` from the seed, and a `dropout` stream that
  nnx.Dropout layers fork at construction (its key is replaced every step, see reseed_for_step)."""
  return nnx.Rngs(params=seed, dropout=jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM))


def reseed_for_step(model, rng_key, step) -> None:
  """Sets every `dropout` stream of `model` to a key that is a pure function of (run key, step).

  Resuming from checkpoint s therefore draws the same dropout masks at step s + 1 as the run it
  continues, whatever RNG state the checkpoint holds. Stacked layers hold one key per layer
  ([layers] shaped): `match_shape` splits this step's key into one per layer.
  """
  step_key = jax.random.fold_in(jax.random.fold_in(rng_key, _DROPOUT_STREAM), step)
  nnx.reseed(model, dropout=step_key, policy="match_shape")


def task_rngs(rng_key, step) -> nnx.Rngs:
  """The `rngs` handed to Task.loss: any randomness a task draws itself (not the model's dropout)."""
  return nnx.Rngs(jax.random.fold_in(jax.random.fold_in(rng_key, _TASK_STREAM), step))


def multi_step(train_step):
  """train_step(state, batch, step, rng_key) -> (state, metrics), turned into one program that runs
  several steps: (state, batches, first_step, count, rng_key) -> (state, metrics).

  `batches` stacks K batches on a leading axis; steps first_step ... first_step + count - 1 read
  batches[0 ... count - 1] (count <= K may vary from call to call without recompiling: the loop's
  trip count is a traced value). Each metric comes back as a [K] array; entries from count on are
  zeros. With K == 1 this is the plain step, no loop.

  Why: XLA:CPU allocates a call's temporaries afresh at every call (~0.9 GB for the benchmark's
  d_model-512, 3+3-layer translator, which the kernel then page-faults back in), and a loop inside
  one call reuses them. Same updates, same order, same keys: only the grouping into calls changes.
  """

  def run(state, batches, first_step, count, rng_key):
    size = jax.tree.leaves(batches)[0].shape[0]
    if size == 1:
      state, metrics = train_step(state, jax.tree.map(lambda x: x[0], batches), first_step, rng_key)
      return state, jax.tree.map(lambda x: x[None], metrics)
    first = jax.tree.map(lambda x: x[0], batches)
    shapes = jax.eval_shape(train_step, state, first, first_step, rng_key)[1]
    zeros = jax.tree.map(lambda s: jnp.zeros((size,) + s.shape, s.dtype), shapes)

    def body(i, carry):
      state, metrics = carry
      batch = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batches)
      state, values = train_step(state, batch, first_step + i, rng_key)
      return state, jax.tree.map(lambda m, v: m.at[i].set(v), metrics, values)

    return jax.lax.fori_loop(0, count, body, (state, zeros))

  return run


class _Run:
  """The pieces of one run, built in order: task, mesh, abstract state, jitted steps."""

  def __init__(self, config, workdir, mode: str = "train"):
    self.config = config
    self.workdir = workdir
    task_class = task_lib.get_task_class(config.task.name)
    try:
      self.task = task_class(config, workdir, mode)
    except validation.ConfigError:
      raise
    except ValueError as error:
      # The user's files are read (and a tokenizer trained) only here, after validation: what is
      # wrong with them is theirs to fix, so it is reported in one line like a config error.
      raise DataError(f"task {config.task.name!r} cannot build its data: {' '.join(str(error).split())}") \
          from None
    self.mesh = sharding.make_mesh(config.mesh)
    self.rules = config.sharding_rules
    self.process_index, self.process_count = jax.process_index(), jax.process_count()
    self.schedule = optim.make_schedule(config.optimizer, config.total_steps)
    tx = optim.make_optimizer(config.optimizer, config.total_steps)
    dtype = jnp.dtype(config.precision.compute_dtype)
    param_dtype = jnp.dtype(config.precision.param_dtype)

    def init():
      with nnx.use_eager_sharding(False):  # placement comes from our rules, below
        model = self.task.make_model(model_rngs(config.seed), dtype=dtype, param_dtype=param_dtype)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    self.graphdef, self.abstract_state = nnx.split(nnx.eval_shape(init))
    self.shardings = sharding.state_shardings(self.abstract_state, self.mesh, self.rules)
    self.init_state = jax.jit(lambda: nnx.state(init()), out_shardings=self.shardings)
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self.task.rows_sharding = self.batch_sharding
    self.stacked_batch_sharding = sharding.batch_sharding(self.mesh, self.rules, stacked=True)
    self._check_process_rows()

  def _check_process_rows(self):
    for size in (self.config.batch_size, self.config.eval_batch_size):
      local = size // self.process_count
      expected = (self.process_index * local, (self.process_index + 1) * local)
      if sharding.process_rows(self.batch_sharding, size) != expected:
        raise RunError(f"the mesh gives process {self.process_index} batch rows "
                       f"{sharding.process_rows(self.batch_sharding, size)}, not {expected}")

  def batch(self, local_batch, global_size, stacked=False):
    return sharding.global_batch(local_batch, self.mesh, self.rules, global_size, stacked=stacked)

  def model(self, state):
    return nnx.merge(self.graphdef, state)[0]

  # Checkpoint items are plain nested dicts of arrays: independent of nnx Variable classes.
  def split_pure(self, state):
    return nnx.to_pure_dict(state[0]), nnx.to_pure_dict(state[1])

  def abstract_pure(self):
    abstract = checkpoints_lib.abstract_with_shardings(self.abstract_state, self.shardings)
    return self.split_pure(abstract)

  def from_pure(self, model_dict, optimizer_dict, state=None):
    state = state if state is not None else jax.tree.map(lambda x: x, self.abstract_state)
    nnx.replace_by_pure_dict(state[0], model_dict)
    if optimizer_dict is not None:
      nnx.replace_by_pure_dict(state[1], optimizer_dict)
    return state

  def make_train_step(self):
    """The jitted `(state, batches, first_step, count, rng_key) -> (state, metrics)`.

    `batches` holds K batches stacked on a leading axis (K = `_stack_depth(config)`, at most
    config.steps_per_call); the call runs the first `count` of them (1 <= count <= K) as
    consecutive updates first_step, first_step + 1, ... inside one program, and returns each
    metric as a [K] array whose first `count` entries are those steps' values.
    """
    task, graphdef, schedule = self.task, self.graphdef, self.schedule
    nan_at_step = self.config.debug.nan_at_step

    def train_step(state, batch, step, rng_key):
      # copy=True: a model holding nnx.Rngs must not mutate the Variables of the traced input.
      model, optimizer = nnx.merge(graphdef, state, copy=True)
      reseed_for_step(model, rng_key, step)

      def loss_fn(model):
        loss, aux = task.loss(model, batch, rngs=task_rngs(rng_key, step))
        if nan_at_step >= 0:  # test-only fault injection (static: costs nothing when off)
          loss = jnp.where(step + 1 == nan_at_step, jnp.nan, loss)
        return loss, aux

      (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
      optimizer.update(model, grads)
      metrics = {"train/loss": loss, "train/grad_norm": optax.tree.norm(grads),
                 "train/learning_rate": schedule(step)}
      metrics.update({f"train/{k}": v for k, v in aux.items()})
      return nnx.state((model, optimizer)), metrics

    return jax.jit(multi_step(train_step), donate_argnums=0,
                   in_shardings=(self.shardings, self.stacked_batch_sharding, None, None, None),
                   out_shardings=(self.shardings, None))

  def evaluate(self, state) -> dict[str, float]:
    if not hasattr(self, "_eval_step"):
      task, graphdef = self.task, self.graphdef
      self._eval_step = jax.jit(
          lambda s, b: task.eval_metrics(nnx.merge(graphdef, s, copy=True)[0], b),
          in_shardings=(self.shardings, self.batch_sharding))
    totals = None
    for local in self.task.eval_batches(process_index=self.process_index,
                                        process_count=self.process_count):
      sums = self._eval_step(state, self.batch(local, self.config.eval_batch_size))
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    totals = jax.device_get(totals) or {}
    values = {f"eval/{k}": float(s) / max(float(w), 1e-12) for k, (s, w) in totals.items()}
    values.update({f"eval/{k}": float(v) for k, v in self.task.extra_eval(self.model(state)).items()})
    return values


def _write_config(config, workdir):
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
  with open(os.path.join(workdir, "config.txt"), "w") as f:
    f.write(str(config))
  with open(os.path.join(workdir, "config.py"), "w") as f:
    f.write('"""The resolved config of this run; pass it back as --config=<this file>."""\n'
            "import json\n\nfrom ml_collections import ConfigDict\n\n"
            f"CONFIG = {config.to_json_best_effort(sort_keys=True)!r}\n\n\n"
            "def get_config(arg=None):\n  return ConfigDict(json.loads(CONFIG))\n")


def _flat(tree: dict, prefix: str = "") -> dict:
  """{"a.b.c": value} of a nested dict."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def _config_differences(config, workdir) -> dict[str, tuple]:
  """{dotted field: (value in the run's config.json, value in `config`)} for every field where they
  differ, sorted by field; {} when the workdir holds no config.json."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    old = _flat(json.load(f))
  new = _flat(json.loads(config.to_json_best_effort()))
  return {key: (old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}


def check_same_model(config, workdir, mode: str = "train"):
  """Raises ConfigError when `config` changes the run already in `workdir`: training must keep its
  model, task and data sections (resuming on other data or another tokenizer is another experiment);
  eval and infer must keep the model and the tokenizer (they may decode differently, e.g. another
  task.beam_size, and evaluate other files)."""
  if not checkpoints_lib.step_numbers(workdir):
    return  # no checkpoint yet (a run that failed before its first save): nothing to protect

  def watched(field):
    if mode == "train":
      return True
    return field.startswith("model.") or field in ("data.tokenizer", "data.vocab_size")

  differences = _config_differences(config, workdir)
  # The first difference reported: another task or model by name (a whole other kind of run: its
  # other fields differ too, and the alphabetically first of them would hide why), then by section.
  reported = [field for field in ("task.name", "model.name") if field in differences] + [
      field for section in ("model", "task", "data") for field in differences
      if field.startswith(section + ".") and watched(field)]
  if reported:
    old, new = differences[reported[0]]
    raise validation.ConfigError(reported[0], new, f"the run in {workdir} was made with {old!r}; keep it, or use "
                                 "a new --workdir")


@contextlib.contextmanager
def _sigterm_flag():
  """Yields a dict whose "stop" turns True on SIGTERM or a first Ctrl-C (SIGINT); a second Ctrl-C
  interrupts at once, as usual. The old handlers are restored afterwards."""
  flag = {"stop": False}

  def handler(signum, frame):
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      if flag["stop"]:
        raise KeyboardInterrupt
      name = "Ctrl-C (press it again to stop without saving)"
    logging.warning("%s received: saving a checkpoint at the end of the current call (or of one "
                    "already queued).", name)
    flag["stop"] = True

  previous = {}
  try:
    for signum in (signal.SIGTERM, signal.SIGINT):
      previous[signum] = signal.signal(signum, handler)
  except ValueError:  # not the main thread: no signal handling
    yield flag
    return
  try:
    yield flag
  finally:
    for signum, old in previous.items():
      signal.signal(signum, old)


def _stop_vote(mesh):
  """flag -> a replicated bool jax.Array, True if `flag` is True on any process (a collective: every
  process calls it at the same step). Dispatched like a train step; reading it waits for it."""
  devices = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
  any_true = jax.jit(jnp.any, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def vote(flag: bool) -> jax.Array:
    local = np.full(len(mesh.local_devices), flag, np.bool_)
    return any_true(jax.make_array_from_process_local_data(devices, local, (mesh.devices.size,)))

  return vote


def _restore(run, checkpoints):
  """(state, step, rng_key) from the workdir, else init_from, else scratch."""
  restored = checkpoints.restore_latest(*run.abstract_pure())
  if restored is not None:
    model_dict, optimizer_dict, meta = restored
    key = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
    logging.info("Resuming from checkpoint step %d in %s", meta["step"], checkpoints.directory)
    return run.from_pure(model_dict, optimizer_dict), meta["step"], key
  state = run.init_state()
  if run.config.init_from:
    model_dict = checkpoints_lib.restore_model_from(run.config.init_from, run.abstract_pure()[0])
    state = run.from_pure(model_dict, None, state)
    logging.info("Initialised parameters from %s", run.config.init_from)
  return state, 0, jax.random.key(run.config.seed)


def _format_duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=int(seconds)))


def steps_per_call(config) -> int:
  """config.steps_per_call; 1 (the behaviour before the field existed) in an older run's config.py."""
  return config.get("steps_per_call", 1)


def _stack_depth(config) -> int:
  """The most steps any call can run: steps_per_call, capped by the loop's lengths."""
  return min(steps_per_call(config), config.total_steps, config.eval_every_steps, config.checkpoint.every_steps)


def _shapes(batch) -> tuple:
  return tuple(np.shape(x) for x in jax.tree.leaves(batch))


def _steps_in_call(step: int, config) -> int:
  """How many steps the call starting after `step` runs: config.steps_per_call, cut short so that
  every eval, checkpoint and the last step end a call (they read the state after that step). The
  loop cuts it shorter where the batches change shape (length bucketing)."""
  count = min(steps_per_call(config), config.total_steps - step)
  for every in (config.eval_every_steps, config.checkpoint.every_steps):
    count = min(count, every - step % every)
  return count


def _call_batches(run: _Run, step: int, ahead: dict):
  """(stacked global batches, count) for the call that starts after `step`.

  The call takes `_steps_in_call` batches, fewer if one changes shape (length bucketing): that batch
  waits in `ahead` for the next call. The stack is filled up to `_stack_depth` with copies of the
  last batch (rows the call does not run), so every call of one batch shape has one program shape.
  """
  local = []
  for i in range(_steps_in_call(step, run.config)):
    batch = ahead.pop(step + i) if step + i in ahead else run.task.train_batch(
        step + i, process_index=run.process_index, process_count=run.process_count)
    if local and _shapes(batch) != _shapes(local[0]):
      ahead[step + i] = batch
      break
    local.append(batch)
  count = len(local)
  local += local[-1:] * (_stack_depth(run.config) - count)
  stacked = jax.tree.map(lambda *rows: np.stack(rows), *local)
  return run.batch(stacked, run.config.batch_size, stacked=True), count


def train(run: _Run, checkpoints, make_writer, after_restore=None) -> dict[str, float]:
  """Trains from wherever `_restore` starts to config.total_steps; returns the last eval metrics.

  `make_writer(start_step)` returns the MetricsWriter (which drops rows past start_step);
  `after_restore()` runs once the checkpoint (if any) has been restored into this config's model.
  """
  config = run.config
  state, start_step, rng_key = _restore(run, checkpoints)
  if start_step > config.total_steps:
    raise validation.ConfigError("total_steps", config.total_steps, f"the run in {run.workdir} is already at step "
                                 f"{start_step}; give more steps to train on, or use --mode=eval")
  if after_restore is not None:
    after_restore()
  if start_step == config.total_steps:
    logging.info("The run is already at step %d = total_steps: nothing to train.", start_step)
  writer = make_writer(start_step)
  train_step = run.make_train_step()
  ahead = {}  # step -> a batch read for a call it did not fit (another shape), kept for the next one
  rng_data = [int(x) for x in np.asarray(jax.random.key_data(rng_key)).ravel()]
  pending: list[tuple[int, int, dict]] = []  # (first step, count, stacked metrics) not yet checked for NaN
  last_eval: dict[str, float] = {}
  step = start_step
  timer_step, timer_start = None, None

  def flush_pending(hold_step=None):
    """Checks every pending step for NaN / inf (in step order) and writes the logged ones.

    The row of `hold_step` is returned instead of written, so its eval metrics can join it.
    """
    held = None
    per_step = [(first + i, {k: v[i] for k, v in stacked.items()})
                for first, count, stacked in jax.device_get(pending) for i in range(count)]
    # The rate since the timer started, up to the newest step here (steps of one call finish together).
    newest = per_step[-1][0] if per_step else None
    rate = (newest - timer_step) / (time.perf_counter() - timer_start) if timer_step is not None and \
        newest is not None and newest > timer_step else float("nan")
    for pending_step, values in per_step:
      for name in ("train/loss", "train/grad_norm"):
        if not np.isfinite(values[name]):
          saved = checkpoints.steps()
          raise TrainingDiverged(
              f"{name} = {float(values[name])} at step {pending_step}; stopping. Last checkpoint: "
              f"{'step ' + str(saved[-1]) if saved else 'none'} (left untouched)")
      if pending_step % config.log_every_steps == 0 or pending_step == config.total_steps:
        row = {k: float(v) for k, v in values.items()}
        if rate == rate:  # no rate yet for the first (compiling) call's steps: left out, not NaN
          row["train/steps_per_second"] = rate
        if pending_step == hold_step:
          held = row
        else:
          writer.write(pending_step, row)
        left = (config.total_steps - pending_step) / rate if rate == rate and rate > 0 else float("nan")
        logging.info("step %d/%d: loss %.4f, grad norm %.3g, %.1f steps/s, %s left", pending_step,
                     config.total_steps, row["train/loss"], row["train/grad_norm"], rate,
                     _format_duration(left) if left == left else "?")
    pending.clear()
    return held or {}

  def save(at_step, metrics=None):
    model_dict, optimizer_dict = run.split_pure(state)
    checkpoints.save(at_step, model_dict, optimizer_dict,
                     {"step": at_step, "rng": rng_data, "metrics": metrics or {}}, metrics)

  with _sigterm_flag() as signal_flag, contextlib.closing(writer):
    stop = False  # agreed by every process, so all of them save and leave at the same step
    vote, last_vote = (_stop_vote(run.mesh) if run.process_count > 1 else None), None
    while step < config.total_steps and not stop:
      batches, count = _call_batches(run, step, ahead)
      state, step_metrics = train_step(state, batches, jnp.asarray(step, jnp.int32), jnp.asarray(count, jnp.int32),
                                       rng_key)
      pending.append((step + 1, count, step_metrics))
      step += count
      if timer_step is None:  # time from the end of the first (compiling) call on
        jax.block_until_ready(step_metrics)
        timer_step, timer_start = step, time.perf_counter()
      if config.debug.step_delay_s:
        time.sleep(config.debug.step_delay_s)
      if vote is None:
        stop = signal_flag["stop"]
      else:  # the previous call's vote (its call is done by now or soon), then this call's
        stop = last_vote is not None and bool(last_vote)
        last_vote = vote(signal_flag["stop"])
        if stop and not signal_flag["stop"]:
          logging.warning("Another process received SIGTERM: saving a checkpoint after step %d.", step)
      is_last = step == config.total_steps
      do_eval = step % config.eval_every_steps == 0 or is_last
      do_save = step % config.checkpoint.every_steps == 0 or is_last or stop
      logged = step // config.log_every_steps > (step - count) // config.log_every_steps  # in this call
      if do_eval or do_save or logged:
        train_row = flush_pending(hold_step=step if do_eval else None)
      if do_eval:
        try:
          last_eval = run.evaluate(state)
        except Exception:  # a bug or bad setting in eval must not cost the training done so far
          if step not in checkpoints.steps():
            logging.error("eval at step %d failed; saving the trained state as checkpoint %d first", step, step)
            save(step)
          raise
        writer.write(step, {**train_row, **last_eval})
        logging.info("step %d eval: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items()))
      if do_save:
        save(step, last_eval if do_eval else None)
      if do_eval or do_save:  # steps/s measures training only
        timer_step, timer_start = step, time.perf_counter()
    flush_pending()
    if stop and step not in checkpoints.steps():
      save(step)
  return last_eval


def _barrier(name: str):
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _quiet_library_logs():
  """Keeps orbax's and jax's INFO chatter (several lines per checkpoint) out of the run's log."""
  def keep(record):
    return record.levelno >= py_logging.WARNING or not any(
        part in record.pathname for part in ("/orbax/", "/jax/", "/jaxlib/"))

  # Library records reach the absl handler both through the absl logger and by propagation from
  # their own Python loggers; the handler that finally writes them is the python_handler.
  logging.get_absl_handler().python_handler.addFilter(keep)


def run(config, workdir: str, mode: str = "train", *, output=None):
  """Validates `config`, then trains (`train`), evaluates the newest checkpoint (`eval`) or runs the
  task's inference on the newest checkpoint (`infer`, lines from config.infer.input_file, "-" = stdin,
  outputs to `output` or stdout). Returns the final eval metrics (train, eval) or the outputs (infer).
  """
  _quiet_library_logs()
  validation.validate_config(config, mode=mode, device_count=jax.device_count(),
                             process_count=jax.process_count())
  check_same_model(config, workdir, mode)
  has_checkpoints = bool(checkpoints_lib.step_numbers(workdir))
  if mode != "train" and not has_checkpoints:  # before anything is built or written: eval / infer only
    # read a finished run
    raise RunError(f"no checkpoint in {os.path.join(os.path.abspath(workdir), 'checkpoints')} to {mode} with")
  is_writer = jax.process_index() == 0
  new_workdir = is_writer and mode == "train" and not os.path.exists(workdir)
  # With checkpoints, the config is rewritten only once they have been restored into its model:
  # a config they do not fit must not replace the one they were made with.
  resumed = mode == "train" and has_checkpoints
  _barrier("config checked")  # every process reads the old config.json before process 0 rewrites it
  if is_writer:
    os.makedirs(workdir, exist_ok=True)
    if mode == "train" and not resumed:
      _write_config(config, workdir)
  _barrier("workdir ready")
  try:
    run_ = _Run(config, workdir, mode)
  except (validation.ConfigError, DataError):
    if new_workdir:  # it holds only this run's config so far: leave nothing half-made behind
      shutil.rmtree(workdir, ignore_errors=True)
    raise
  checkpoints = checkpoints_lib.Checkpoints(
      workdir, keep=config.checkpoint.keep, best_metric=config.checkpoint.best_metric,
      best_mode=config.checkpoint.best_mode)
  try:
    if mode == "train":
      result = train(run_, checkpoints, lambda start_step: metrics_lib.MetricsWriter(
          workdir, active=is_writer, tensorboard=config.logging.tensorboard, resume_step=start_step),
          after_restore=(lambda: _write_config(config, workdir)) if resumed and is_writer else None)
      if is_writer and config.logging.plot:
        metrics_lib.plot_losses(workdir)
      return result
    state, step = _latest_state(run_, checkpoints, mode)
    if mode == "eval":
      values = run_.evaluate(state)
      logging.info("eval at step %d: %s", step, values)
      if is_writer:
        # The fields this eval changed from the run's config (another data.grid, task.beam_size ...).
        changed = {field: new for field, (_, new) in _config_differences(config, workdir).items()}
        with open(os.path.join(workdir, "eval_results.jsonl"), "a") as f:
          f.write(json.dumps({"step": step, **values, "changed": changed}) + "\n")
      return values
    return _infer(run_, state, config.infer.input_file, output)
  finally:
    checkpoints.close()


def _latest_state(run_, checkpoints, purpose: str):
  """(state, step) of the newest readable checkpoint; RunError when there is none."""
  restored = checkpoints.restore_latest(*run_.abstract_pure())
  if restored is None:
    raise RunError(f"no checkpoint in {checkpoints.directory} to {purpose} with")
  return run_.from_pure(restored[0], restored[1]), restored[2]["step"]


def _read_input_lines(input_file) -> tuple[str, list[str]]:
  """(name for messages, lines) of an inference input: a UTF-8 file, or "-" for stdin."""
  import sys
  name = "<stdin>" if input_file == "-" else input_file
  if input_file == "-":
    raw = sys.stdin.buffer.read()
  else:
    with open(input_file, "rb") as f:
      raw = f.read()
  # Lines end at \n (\r\n too), not at U+2028, \x0c, \x85 ... as str.splitlines would have it.
  raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not part of line 1
  raw_lines = raw.split(b"\n")
  if raw_lines[-1] == b"":
    raw_lines.pop()
  lines = []
  for number, line in enumerate(raw_lines, 1):
    try:
      lines.append(line.removesuffix(b"\r").decode("utf-8"))
    except UnicodeDecodeError as error:
      raise DataError(f"{name}:{number}: not valid UTF-8 at byte {error.start + 1} of the line") from None
  return name, lines


def load_model(workdir: str):
  """(model, task) of the newest checkpoint of a run, for notebooks and scripts:

      model, task = loop.load_model("workdirs/dates")
      task.infer(model, ["Sunday, November 29, 2026"])   # the task's own inference

  The run's resolved config (`<workdir>/config.py`) rebuilds the task in "infer" mode (it reads the
  workdir's tokenizer, not the training data); the model is `task.config`'s, restored in place.
  """
  path = os.path.join(workdir, "config.py")
  if not os.path.isfile(path):
    raise RunError(f"{workdir} holds no config.py: is it a run's workdir?")
  config = validation.load_config_file(path)
  validation.validate_config(config, mode="infer", device_count=jax.device_count(),
                             process_count=jax.process_count())
  run_ = _Run(config, workdir, "infer")
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=config.checkpoint.keep)
  try:
    state, _ = _latest_state(run_, checkpoints, "load")
  finally:
    checkpoints.close()
  return run_.model(state), run_.task


def _infer(run_, state, input_file, output):
  """One output line per input line, in order; a blank input line gets a blank output line."""
  import sys
  name, lines = _read_input_lines(input_file)
  numbers = [number for number, line in enumerate(lines, 1) if line.strip()]
  try:
    answers = run_.task.infer(run_.model(state), [lines[number - 1] for number in numbers]) if numbers else []
  except task_lib.InputLineError as error:
    raise DataError(f"{name}:{numbers[error.index]}: {error.message}") from None
  by_number = dict(zip(numbers, answers))
  outputs = [by_number.get(number, "") for number in range(1, len(lines) + 1)]
  if jax.process_index() == 0:
    stream = output or sys.stdout
    for line in outputs:
      stream.write(line + "\n")
    stream.flush()
  return outputs
