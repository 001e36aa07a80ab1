"""`Trainer`: the pieces one config assembles, in order: task, mesh, abstract state, shardings, the
jitted train and eval steps; and where the state comes from (the resume order) and goes (checkpoints).

The state is the pair (model state, optimizer state) of nnx.States, sharded by the config's rules.
Where a train run starts (the resume order, `Trainer.restore`):
  1. the newest readable checkpoint in `<workdir>/checkpoints` (step, parameters, optimizer state,
     RNG key; the data position is the step itself, so the losses continue exactly);
  2. otherwise `config.init_from` (parameters only; step 0, a fresh optimizer);
  3. otherwise from scratch (parameters from `config.seed`).
Checkpoint s holds the state after update s (1-based), which read train batch s - 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import optim, rng, schedule, sharding, task as task_lib, validation
from xattn_jax.training.errors import DataError, RunError


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

  # The loop body calls the step through jit so that the trace `eval_shape` makes for the metrics'
  # shapes is cached and reused by the loop's trace (XLA inlines the call: the same program).
  traced_step = jax.jit(train_step)

  def steps(state, batches, first_step, count, rng_key):
    size = jax.tree.leaves(batches)[0].shape[0]
    if size == 1:
      state, metrics = train_step(state, jax.tree.map(lambda x: x[0], batches), first_step, rng_key)
      return state, jax.tree.map(lambda x: x[None], metrics)
    first = jax.tree.map(lambda x: x[0], batches)
    shapes = jax.eval_shape(traced_step, state, first, first_step, rng_key)[1]
    zeros = jax.tree.map(lambda s: jnp.zeros((size,) + s.shape, s.dtype), shapes)

    def body(i, carry):
      state, metrics = carry
      batch = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), batches)
      state, values = traced_step(state, batch, first_step + i, rng_key)
      return state, jax.tree.map(lambda m, v: m.at[i].set(v), metrics, values)

    return jax.lax.fori_loop(0, count, body, (state, zeros))

  return steps


def check_rows(batch, rows: int, where: str, why: str) -> None:
  """A task's batch as the Task contract asks: a dict of arrays, each with `rows` rows on axis 0. RunError naming
  the method, the array and its shape otherwise (XLA's own error, raised later, names neither)."""
  if not isinstance(batch, dict):
    raise RunError(f"{where} gave a {type(batch).__name__}: the Task contract asks for a dict of arrays, each with "
                   f"the batch on axis 0")
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if np.shape(leaf)[:1] != (rows,):
      raise RunError(f"{where} gave {jax.tree_util.keystr(path)} of shape {np.shape(leaf)}: every array needs "
                     f"{rows} rows on axis 0 ({why})")


def check_scalars(values: dict, where: str) -> None:
  """Traced: each of `values` ({name: array}) a scalar, as the loop logs and differentiates them; RunError naming
  the method and the value otherwise."""
  for name, value in values.items():
    if jnp.ndim(value):
      raise RunError(f"{where} gave {name} of shape {jnp.shape(value)}: needs a scalar")


def check_sum_weight_pairs(metrics, where: str) -> None:
  """Traced: `metrics` as eval_metrics and loss_terms' aux give them, {name: (sum, weight)} of scalars; RunError
  naming the method and the metric otherwise."""
  if not isinstance(metrics, dict):
    raise RunError(f"{where} gave a {type(metrics).__name__}: the Task contract asks for a dict {{name: (sum, weight)}}")
  for name, pair in metrics.items():
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
      got = f"an array of shape {jnp.shape(pair)}" if hasattr(pair, "shape") else f"a {type(pair).__name__}"
      raise RunError(f"{where} gave {name!r} as {got}: the Task contract asks for a (sum, weight) pair of scalars, "
                     f"whose totals over the batches the loop divides")
    check_scalars({f"{name!r} sum": pair[0], f"{name!r} weight": pair[1]}, where)


def accumulated_gradients(task, model, batch, microbatches: int, rng_key, step):
  """((mean loss, its gradient wrt the model's nnx.Params), aux means) of the whole batch, computed over
  `microbatches` equal microbatches in sequence: their loss sums, weights, gradient sums and aux (sum, weight)
  pairs add up, one division at the end.

  Microbatch j holds rows j, j + k, j + 2k, ... (k = microbatches), so each device's rows of the batch split
  evenly among them. The model's other state (dropout streams) is carried from one microbatch to the next, and
  the task's own randomness gets one stream per microbatch (`rng.task_rngs`).
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]),
                                              0, 1), batch)  # [k, B / k, ...]

  def terms(model, rows, index):
    total, weight, aux = task.loss_terms(model, rows, rngs=rng.task_rngs(rng_key, step, index))
    check_scalars({"loss_sum": total, "weight_sum": weight}, f"{type(task).__name__}.loss_terms")
    check_sum_weight_pairs(aux, f"{type(task).__name__}.loss_terms aux")
    as_float = lambda x: jnp.asarray(x, jnp.float32)  # the scan's carry keeps one dtype (a count may be an int)
    return as_float(total), (as_float(weight), jax.tree.map(as_float, aux))

  def one(carry, inputs):
    params, rest, gradient_sum, sums = carry  # params ride along unchanged: nnx wants the model's
    rows, index = inputs                      # Variables at the loop's trace level
    model = nnx.merge(graphdef, params, rest)
    (total, (weight, aux)), gradient = nnx.value_and_grad(terms, has_aux=True)(model, rows, index)
    gradient_sum = jax.tree.map(lambda total, g: total + g.astype(total.dtype), gradient_sum, gradient)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return (params, rest, gradient_sum, jax.tree.map(jnp.add, sums, (total, weight, aux))), None

  # The sums start as zeros of the terms' structure (the aux names are the task's).
  _, (_, aux_shape) = jax.eval_shape(lambda params, rest, rows: terms(nnx.merge(graphdef, params, rest), rows, 0),
                                     params, rest, jax.tree.map(lambda x: x[0], micro))
  # Gradients add up in float32 at least (bfloat16 parameters' too) and come back in each parameter's dtype,
  # as the whole batch's gradient does: the optimizer's state keeps its dtype from step to step.
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
  start = (params, rest, zeros, jax.tree.map(lambda _: jnp.zeros((), jnp.float32), (0.0, 0.0, aux_shape)))
  (_, rest, gradient_sum, (loss_sum, weight_sum, aux)), _ = jax.lax.scan(
      one, start, (micro, jnp.arange(microbatches)))
  nnx.update(model, rest)
  weight = jnp.maximum(weight_sum, 1.0)
  loss, aux_means = task_lib.mean_terms(loss_sum, weight_sum, aux)
  return (loss, jax.tree.map(lambda g, p: (g / weight).astype(p.dtype), gradient_sum, params)), aux_means


def initial_model(task, seed: int, *, dtype, param_dtype) -> nnx.Module:
  """The task's model from `seed`, its parameters in param_dtype: drawn in float32 and rounded to a narrower
  param_dtype, so that a bfloat16-parameter run starts from the float32 run's weights. (JAX draws bfloat16
  random numbers from other bits: they are other weights altogether, which would make a param_dtype ablation
  compare two initializations as well as two precisions.) Parameters that the model keeps in float32 whatever
  param_dtype says stay float32."""
  if jnp.dtype(param_dtype) == jnp.float32:
    return task.make_model(rng.model_rngs(seed), dtype=dtype, param_dtype=param_dtype)
  model = task.make_model(rng.model_rngs(seed), dtype=dtype, param_dtype=jnp.float32)
  wanted = nnx.state(nnx.eval_shape(lambda: task.make_model(rng.model_rngs(seed), dtype=dtype,
                                                             param_dtype=param_dtype)), nnx.Param)
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x, like: x.astype(like.dtype), params, wanted))
  return model


def _eval_batch_on_mesh(config):
  """`config` as eval and infer read it on this process's devices: as it is, or a copy whose eval_batch_size is
  rounded up to a multiple of the shards the rows split into here (a run trained on 8 devices with 8-row batches,
  read on 3), so that any device count evaluates a run; logged."""
  size = validation.eval_batch_size_on_mesh(config, jax.device_count())
  if size == config.eval_batch_size:
    return config
  logging.info("eval_batch_size=%d does not split evenly over the batch shards of the mesh on these %d device(s): "
               "reading batches of %d rows (weight-0 rows fill what the examples leave)", config.eval_batch_size,
               jax.device_count(), size)
  resized = config.copy_and_resolve_references()
  resized.eval_batch_size = size
  return resized


def _sized_by_epochs(config, task):
  """`config` ending where `schedule.end_step` says: as it is, or a copy whose total_steps is the step that
  completes config.max_epochs passes over the task's training data, so that the schedule, the loop and the
  learning rate all end there (the workdir keeps the config as written)."""
  if not config.get("max_epochs", 0.0):
    return config
  per_epoch = task.steps_per_epoch()
  if per_epoch is None:
    raise validation.ConfigError("max_epochs", config.max_epochs, f"task {config.task.name!r} does not count "
                                 "the steps of a pass over its training data: leave it 0 (total_steps alone)")
  end = schedule.end_step(config, per_epoch)
  if end == schedule.passes_step(config.max_epochs, per_epoch):
    bound = "the passes"
  elif end == config.total_steps:  # it caps min_steps too
    bound = "total_steps" + (", which comes before min_steps" if config.total_steps < config.min_steps else "")
  else:
    bound = "min_steps"
  logging.info("Training ends at step %d, set by %s: max_epochs=%g passes of %d steps, at least min_steps=%d, at "
               "most total_steps=%d", end, bound, config.max_epochs, per_epoch, config.min_steps, config.total_steps)
  if end == config.total_steps:
    return config
  sized = config.copy_and_resolve_references()
  sized.total_steps = end
  return sized


class Trainer:
  """The task, mesh, state layout and jitted steps of one config (train, eval and infer all build one).

  Reaches the task only through the registry (`task.get_task_class(config.task.name)`).
  """

  def __init__(self, config, workdir: str, mode: str = "train"):
    if mode != "train":  # training's mesh divides its batches (validation.check_mesh); this one may be another
      config = _eval_batch_on_mesh(config)
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
    sized = _sized_by_epochs(config, self.task) if mode == "train" else config
    self.ended_by_epochs = sized is not config  # max_epochs ends the run before the total_steps written
    self.config = config = sized
    if self.ended_by_epochs:  # validation saw the total_steps written
      validation.check_profile_window(config, workdir)
    self.mesh = sharding.make_mesh(config.mesh)
    self.rules = config.sharding_rules
    self.process_index, self.process_count = jax.process_index(), jax.process_count()
    self.learning_rate = optim.make_schedule(config.optimizer, config.total_steps)
    if mode == "train" and config.optimizer.warmup_steps >= config.total_steps:
      logging.warning("optimizer.warmup_steps=%d >= total_steps=%d: the learning rate never reaches its peak "
                      "%g (the last step's is %.3g)", config.optimizer.warmup_steps, config.total_steps,
                      config.optimizer.learning_rate, float(self.learning_rate(config.total_steps - 1)))
    tx = optim.make_optimizer(config.optimizer, config.total_steps)
    dtype = jnp.dtype(config.precision.compute_dtype)
    param_dtype = jnp.dtype(config.precision.param_dtype)

    loaded = self.task.loaded_params()

    def init(loaded=None):
      with nnx.use_eager_sharding(False):  # placement comes from our rules, below
        model = initial_model(self.task, config.seed, dtype=dtype, param_dtype=param_dtype)
        if loaded is not None:  # the values make_model set, as the program's arguments instead of its constants
          state = nnx.state(model)
          nnx.replace_by_pure_dict(state, loaded)
          nnx.update(model, state)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    self.graphdef, self.abstract_state = nnx.split(nnx.eval_shape(init))
    if mode == "train" and optim.reads(config.optimizer, "weight_decay_exclude"):
      self._check_weight_decay_exclude(config.optimizer.weight_decay_exclude)
    if mode == "train" and (unread := optim.unread_fields(config.optimizer)):
      logging.info("optimizer.name=%r with schedule %r reads no %s: their values are unused", config.optimizer.name,
                   config.optimizer.schedule, ", ".join(f"optimizer.{field}" for field in unread))
    self.shardings = sharding.state_shardings(self.abstract_state, self.mesh, self.rules)
    self.init_program = jax.jit(lambda loaded: nnx.state(init(loaded)), out_shardings=self.shardings)
    self.init_state = lambda: self.init_program(loaded)
    self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
    self.task.rows_sharding = self.batch_sharding
    self.task.logits_sharding = sharding.logits_sharding(self.mesh, self.rules)
    self.stacked_batch_sharding = sharding.batch_sharding(self.mesh, self.rules, stacked=True)
    self._eval_step = None
    self._check_process_rows(mode)

  def summary(self) -> str:
    """One line on what a step trains, and where: the model's trainable parameters (nnx.Param) and its other
    floating-point values (frozen parts, fixed tables), the mesh, and the global batch."""
    counts = {"trainable": 0, "fixed": 0}
    nbytes = dict(counts)
    for variable in jax.tree.leaves(self.abstract_state[0], is_leaf=lambda x: isinstance(x, nnx.Variable)):
      value = variable.get_value() if isinstance(variable, nnx.Variable) else variable
      if not jnp.issubdtype(value.dtype, jnp.floating):
        continue  # RNG keys and counters
      kind = "trainable" if isinstance(variable, nnx.Param) else "fixed"
      counts[kind] += int(np.prod(value.shape))
      nbytes[kind] += int(np.prod(value.shape)) * value.dtype.itemsize
    mesh = " x ".join(f"{axis}={size}" for axis, size in self.mesh.shape.items())
    devices = self.mesh.devices.flat[0].platform
    size = lambda n: f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"
    fixed = (f", {counts['fixed']:,} other values not trained ({size(nbytes['fixed'])}: frozen parts, fixed tables)"
             if counts["fixed"] else "")
    return (f"Model: {counts['trainable']:,} trainable parameters ({size(nbytes['trainable'])}){fixed}; "
            f"mesh {mesh} over {self.mesh.devices.size} {devices} device(s) in {self.process_count} process(es); "
            f"global batch {self.config.batch_size}")

  def _check_weight_decay_exclude(self, exclude: str):
    """A name in optimizer.weight_decay_exclude that no trainable parameter's path contains is refused: a
    misspelt one would exclude nothing, silently. The default's names are kept whether the model has them."""
    params = nnx.filter_state(self.abstract_state[0], nnx.Param)
    unmatched = optim.unmatched_exclude_patterns(params, exclude)
    if unmatched:
      parts = sorted({part for name in optim.parameter_names(params)
                      for part in name.split("/") if not part.isdigit()})
      raise validation.ConfigError(
          "optimizer.weight_decay_exclude", exclude,
          f"{', '.join(repr(p) for p in unmatched)} is part of no trainable parameter's path; allowed are "
          f"substrings of the paths, whose parts are {', '.join(parts)}")

  def _check_process_rows(self, mode: str):
    sizes = (self.config.batch_size, self.config.eval_batch_size) if mode == "train" else (self.config.eval_batch_size,)
    for size in sizes:  # eval and infer read no training batch
      local = size // self.process_count
      expected = (self.process_index * local, (self.process_index + 1) * local)
      if sharding.process_rows(self.batch_sharding, size) != expected:
        raise RunError(f"the mesh gives process {self.process_index} batch rows "
                       f"{sharding.process_rows(self.batch_sharding, size)}, not {expected}")

  def batch(self, local_batch, global_size, stacked=False):
    """This process's rows as one global batch on the mesh (stacked: [K, global_size, ...])."""
    return sharding.global_batch(local_batch, self.mesh, self.rules, global_size, stacked=stacked)

  def read_train_batch(self, index: int) -> dict:
    """This process's rows of train batch `index` (0-based)."""
    batch = self.task.train_batch(index, process_index=self.process_index, process_count=self.process_count)
    check_rows(batch, self.config.batch_size // self.process_count, f"{type(self.task).__name__}.train_batch(step "
               f"{index})", f"batch_size {self.config.batch_size} over {self.process_count} process(es)")
    return batch

  def model(self, state):
    return nnx.merge(self.graphdef, state)[0]

  # Checkpoint items are plain nested dicts of arrays: independent of nnx Variable classes.
  def split_pure(self, state):
    """(model dict, optimizer dict) of `state`, the items a checkpoint stores."""
    return nnx.to_pure_dict(state[0]), nnx.to_pure_dict(state[1])

  def abstract_pure(self):
    abstract = checkpoints_lib.abstract_with_shardings(self.abstract_state, self.shardings)
    return self.split_pure(abstract)

  def from_pure(self, model_dict, optimizer_dict, state=None):
    """A state holding `model_dict` (and `optimizer_dict` unless None), filled into `state` or into
    a copy of the abstract state."""
    state = state if state is not None else jax.tree.map(lambda x: x, self.abstract_state)
    nnx.replace_by_pure_dict(state[0], model_dict)
    if optimizer_dict is not None:
      nnx.replace_by_pure_dict(state[1], optimizer_dict)
    return state

  def make_train_step(self):
    """The jitted `(state, batches, first_step, count, rng_key) -> (state, metrics)`.

    `batches` holds K batches stacked on a leading axis (K = `schedule.stack_depth(config)`, at
    most config.steps_per_call); the call runs the first `count` of them (1 <= count <= K) as
    consecutive updates first_step, first_step + 1, ... inside one program, and returns each
    metric as a [K] array whose first `count` entries are those steps' values. The state is donated.
    """
    task, graphdef, learning_rate = self.task, self.graphdef, self.learning_rate
    nan_at_step = self.config.debug.nan_at_step
    microbatches = self.config.get("num_microbatches", 1)

    def train_step(state, batch, step, rng_key):
      # copy=True: a model holding nnx.Rngs must not mutate the Variables of the traced input.
      model, optimizer = nnx.merge(graphdef, state, copy=True)
      rng.reseed_for_step(model, rng_key, step)

      def loss_fn(model):
        loss, aux = task.loss(model, batch, rngs=rng.task_rngs(rng_key, step))
        check_scalars({"the loss": loss, **{f"aux {name!r}": value for name, value in aux.items()}},
                      f"{type(task).__name__}.loss")
        if nan_at_step >= 0:  # test-only fault injection (static: costs nothing when off)
          loss = jnp.where(step + 1 == nan_at_step, jnp.nan, loss)
        return loss, aux

      if microbatches == 1:
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
      else:
        (loss, grads), aux = accumulated_gradients(task, model, batch, microbatches, rng_key, step)
        if nan_at_step >= 0:
          loss = jnp.where(step + 1 == nan_at_step, jnp.nan, loss)
      optimizer.update(model, grads)
      metrics = {"train/loss": loss, "train/grad_norm": optax.tree.norm(grads),
                 "train/learning_rate": learning_rate(step)}
      metrics.update({f"train/{k}": v for k, v in aux.items()})
      return nnx.state((model, optimizer)), metrics

    return jax.jit(multi_step(train_step), donate_argnums=0,
                   in_shardings=(self.shardings, self.stacked_batch_sharding, None, None, None),
                   out_shardings=(self.shardings, None))

  def evaluate(self, state) -> dict[str, float]:
    """{"eval/<name>": value}: the task's eval metrics summed over every eval batch (sum / weight), what
    derived_eval makes of them, and its host-side extra_eval."""
    if self._eval_step is None:
      task, graphdef = self.task, self.graphdef
      def eval_step(state, batch):
        metrics = task.eval_metrics(nnx.merge(graphdef, state, copy=True)[0], batch)
        check_sum_weight_pairs(metrics, f"{type(task).__name__}.eval_metrics")
        return metrics
      self._eval_step = jax.jit(eval_step, in_shardings=(self.shardings, self.batch_sharding))
    totals = None
    for local in self.task.eval_batches(process_index=self.process_index,
                                        process_count=self.process_count):
      check_rows(local, self.config.eval_batch_size // self.process_count,
                 f"{type(self.task).__name__}.eval_batches",
                 f"eval_batch_size {self.config.eval_batch_size} over {self.process_count} process(es)")
      sums = self._eval_step(state, self.batch(local, self.config.eval_batch_size))
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    totals = jax.device_get(totals) or {}
    summed = {k: float(s) / max(float(w), 1e-12) for k, (s, w) in totals.items()}
    values = {f"eval/{k}": v for k, v in {**summed, **self.task.derived_eval(summed)}.items()}
    values.update({f"eval/{k}": float(v) for k, v in self.task.extra_eval(self.model(state)).items()})
    return values

  def restore(self, checkpoints: checkpoints_lib.Checkpoints):
    """(state, step, rng_key) where training starts: the workdir's newest readable checkpoint, else
    config.init_from's parameters at step 0, else the seed's."""
    restored = checkpoints.restore_latest(*self.abstract_pure())
    if restored is not None:
      model_dict, optimizer_dict, meta = restored
      key = jax.random.wrap_key_data(np.asarray(meta["rng"], np.uint32))
      logging.info("Resuming from checkpoint step %d in %s", meta["step"], checkpoints.directory)
      return self.from_pure(model_dict, optimizer_dict), meta["step"], key
    state = self.init_state()
    if self.config.init_from:
      model_dict = checkpoints_lib.restore_model_from(self.config.init_from, self.abstract_pure()[0])
      state = self.from_pure(model_dict, None, state)
      logging.info("Initialised parameters from %s", self.config.init_from)
    return state, 0, jax.random.key(self.config.seed)

  def latest_state(self, checkpoints: checkpoints_lib.Checkpoints, purpose: str):
    """(state, step) of the checkpoint config.checkpoint.eval_from names: the newest readable one, the best by
    checkpoint.best_metric, or a step number; RunError naming `purpose` when there is none."""
    eval_from = self.config.checkpoint.get("eval_from", "latest")
    steps = checkpoints_lib.steps_to_read(checkpoints, eval_from)
    if steps is not None:
      logging.info("Reading checkpoint step %d (checkpoint.eval_from=%r%s)", steps[0], eval_from,
                   f", the best by {checkpoints.best_metric}" if eval_from == "best" else "")
    restored = checkpoints.restore_latest(*self.abstract_pure(), steps=steps, quarantine=False)  # only reads
    if restored is None:
      raise RunError(f"no checkpoint in {checkpoints.directory} to {purpose} with")
    if steps is None:  # said once read: a run training in the workdir may have saved a newer one meanwhile
      logging.info("Read checkpoint step %d, the newest readable in %s", restored[2]["step"], checkpoints.directory)
    return self.from_pure(restored[0], restored[1]), restored[2]["step"]

  def save(self, checkpoints: checkpoints_lib.Checkpoints, step: int, state, rng_key, metrics=None):
    """Checkpoint `step`: the state, the run's RNG key data and the eval metrics at that step (if
    any; the best-checkpoint policy reads them). A step already saved is left as it is."""
    model_dict, optimizer_dict = self.split_pure(state)
    rng_data = [int(x) for x in np.asarray(jax.random.key_data(rng_key)).ravel()]
    checkpoints.save(step, model_dict, optimizer_dict,
                     {"step": step, "rng": rng_data, "metrics": metrics or {}}, metrics)
