"""The Trainer: multi-step calls, the train step's update, the resume order, checkpoint round trips."""
import logging
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import template
from xattn_jax.tasks import template as template_task
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import loop, metrics as metrics_lib, optim, schedule, task as task_lib, validation
from xattn_jax.training.errors import DataError, RunError
from xattn_jax.training.trainer import Trainer, multi_step


def _sgd_step(state, batch, step, rng_key):
  """A stand-in train step: one SGD update of a linear least-squares model, key and step mixed in."""
  def loss_fn(w):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

  loss, grad = jax.value_and_grad(loss_fn)(state["w"])
  noise = jax.random.normal(jax.random.fold_in(rng_key, step), state["w"].shape)
  new = {"w": state["w"] - 0.1 * grad + 1e-3 * noise, "count": state["count"] + 1}
  return new, {"loss": loss, "step": step}


@pytest.mark.parametrize("size,count", [(4, 4), (4, 3), (4, 1), (1, 1)])
def test_multi_step_equals_that_many_single_steps(size, count):
  rng = np.random.default_rng(0)
  batches = {"x": jnp.asarray(rng.standard_normal((size, 8, 5)), jnp.float32),
             "y": jnp.asarray(rng.standard_normal((size, 8, 3)), jnp.float32)}
  state = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), "count": jnp.int32(0)}
  key, first = jax.random.key(7), jnp.int32(10)
  multi_state, metrics = jax.jit(multi_step(_sgd_step))(state, batches, first, jnp.int32(count), key)

  single = jax.jit(_sgd_step)
  expected, losses = state, []
  for i in range(count):
    expected, values = single(expected, jax.tree.map(lambda x: x[i], batches), first + i, key)
    losses.append(values["loss"])
  assert int(multi_state["count"]) == count
  np.testing.assert_allclose(multi_state["w"], expected["w"], rtol=1e-6, atol=1e-6)
  assert metrics["loss"].shape == metrics["step"].shape == (size,)
  np.testing.assert_allclose(metrics["loss"][:count], losses, rtol=1e-6)
  np.testing.assert_array_equal(metrics["step"][:count], 10 + np.arange(count))
  assert not np.any(metrics["loss"][count:])  # entries past count are zeros


def test_multi_step_takes_a_different_count_without_retracing():
  traced = []

  def step(state, batch, step, rng_key):
    traced.append(1)
    return _sgd_step(state, batch, step, rng_key)

  steps = jax.jit(multi_step(step))
  batches = {"x": jnp.ones((3, 2, 5)), "y": jnp.ones((3, 2, 3))}
  state = {"w": jnp.zeros((5, 3)), "count": jnp.int32(0)}
  for count in (3, 1, 2):
    state, _ = steps(state, batches, jnp.int32(0), jnp.int32(count), jax.random.key(0))
  assert int(state["count"]) == 6
  traces = len(traced)
  steps(state, batches, jnp.int32(0), jnp.int32(3), jax.random.key(0))
  assert len(traced) == traces


def _float_leaves(model_dict):
  return [np.asarray(x) for x in jax.tree.leaves(model_dict) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_a_warmup_as_long_as_the_run_is_said_once(tmp_path, caplog):
  """A smoke run of 3 steps under the default 100 warm-up steps trains at ~1% of the peak rate."""
  caplog.set_level(logging.WARNING)
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"total_steps": 3, "eval_every_steps": 3, "checkpoint.every_steps": 3})
  Trainer(config, str(tmp_path))
  said = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith("optimizer.warmup_steps=100 >= total_steps=3: the learning rate never")
  caplog.clear()
  config.optimizer.warmup_steps = 2
  Trainer(config, str(tmp_path))
  assert not [r for r in caplog.records if "warmup_steps" in r.getMessage()]


def test_a_weight_decay_exclusion_that_names_no_parameter_is_refused_naming_it(tmp_path, monkeypatch):
  """'bias,scale,embeding' excluded nothing from weight decay and said nothing: a name no trainable parameter's
  path contains is refused, naming it and the paths; the default's names are kept even where a model lacks one."""
  config = template.get_config("size=tiny")
  config.optimizer.weight_decay_exclude = "bias,scale,embeding,kernal"
  said = r"'embeding', 'kernal' is part of no trainable parameter's path; allowed are substrings of the paths"
  with pytest.raises(validation.ConfigError, match=said + r", whose parts are .*\bkernel\b") as error:
    Trainer(config, str(tmp_path))
  assert error.value.field == "optimizer.weight_decay_exclude" and "/.value" not in str(error.value)
  config.optimizer.weight_decay_exclude = "bias,scale,embedding,no_such_default_name_but_unused"
  config.optimizer.name = "sgd"  # reads no exclusions
  Trainer(config, str(tmp_path))
  config.optimizer.name = "adamw"
  with pytest.raises(validation.ConfigError):
    Trainer(config, str(tmp_path))
  # checked for any optimizer whose registry entry reads the field (it was the name "adamw" only)
  monkeypatch.setitem(optim.OPTIMIZERS, "adamw_of_yours", optim.OPTIMIZERS["adamw"])
  config.optimizer.name = "adamw_of_yours"
  with pytest.raises(validation.ConfigError):
    Trainer(config, str(tmp_path))
  config.optimizer.name = "adamw"
  Trainer(config, str(tmp_path), mode="eval")  # eval applies no update
  config.optimizer.weight_decay_exclude = "bias,scale,embedding,kernel"
  Trainer(config, str(tmp_path))


@pytest.mark.parametrize("mode", ["eval", "infer"])
def test_eval_and_infer_read_batches_their_mesh_divides(tmp_path, monkeypatch, mode):
  """A run trained in 8-row eval batches on 8 devices, evaluated on 3: eval and infer read 9-row batches (weight-0
  rows fill the last), where the 8 rows could not split over 3 devices. This process has one device: the count is
  pretended, as validation and the rounding read it (the mesh itself takes the one device there is)."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"batch_size": 8, "eval_batch_size": 8, "task.num_eval_examples": 16})
  monkeypatch.setattr(jax, "device_count", lambda *backend: 3)
  trainer = Trainer(config, str(tmp_path), mode)
  assert trainer.config.eval_batch_size == 9 and config.eval_batch_size == 8  # the run's config is left as it is
  batches = list(trainer.task.eval_batches(process_index=0, process_count=1))
  assert [len(batch["weights"]) for batch in batches] == [9, 9]
  assert sum(float(batch["weights"].sum()) for batch in batches) == 16  # every example once, 2 rows of padding


def test_a_train_call_updates_every_parameter_and_reports_its_steps(tmp_path):
  """A train step that skipped the optimizer update would leave the parameters as they were."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"batch_size": 8, "steps_per_call": 2, "total_steps": 4,
                                     "eval_every_steps": 4, "checkpoint.every_steps": 4})
  trainer = Trainer(config, str(tmp_path))
  state = trainer.init_state()
  before = _float_leaves(trainer.split_pure(state)[0])
  batches, count = schedule.CallFeed(trainer.read_train_batch, config).next_call(0)
  state, metrics = trainer.make_train_step()(state, trainer.batch(batches, config.batch_size, stacked=True),
                                             jnp.int32(0), jnp.int32(count), jax.random.key(0))
  after = _float_leaves(trainer.split_pure(state)[0])
  assert count == 2 and all(not np.array_equal(a, b) for a, b in zip(before, after))
  assert metrics["train/loss"].shape == (2,) and np.all(np.isfinite(metrics["train/loss"]))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A toy run's state saved at step 3 with recognisable parameters (all ones)."""
  workdir = str(tmp_path_factory.mktemp("saved"))
  config = template.get_config("size=tiny")
  trainer = Trainer(config, workdir)
  state = trainer.init_state()
  model_dict, optimizer_dict = trainer.split_pure(state)
  model_dict = jax.tree.map(jnp.ones_like, model_dict)
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=2)
  checkpoints.save(3, model_dict, optimizer_dict, {"step": 3, "rng": [0, 7]})
  checkpoints.close()
  return config, trainer, workdir


def _restore(config, workdir):
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=2)
  try:
    return Trainer(config, workdir).restore(checkpoints)
  finally:
    checkpoints.close()


def _all_ones(state):
  """All model leaves are ones, except PRNG keys (the dropout streams), which have no numeric value."""
  leaves = [x for x in jax.tree.leaves(state[0]) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  return bool(leaves) and all(np.all(np.asarray(x) == 1) for x in leaves)


def test_init_from_loads_parameters_at_step_zero(saved_run, tmp_path, caplog):
  config, _, saved_workdir = saved_run
  config = config.copy_and_resolve_references()
  config.init_from = f"{saved_workdir}/checkpoints"
  caplog.set_level("INFO")
  state, step, _ = _restore(config, str(tmp_path))
  assert step == 0 and _all_ones(state)
  assert "init_from: reading the parameters of checkpoint step 3" in caplog.text  # which step it took


@pytest.mark.parametrize("saved_optimizer", ["adamw", "sgd"])
def test_init_from_takes_the_parameters_alone_with_a_fresh_optimizer_whatever_the_saved_one(saved_optimizer,
                                                                                             tmp_path):
  """No saved optimizer value reaches the new run (the saved run above stores a fresh optimizer: that test could
  not tell), and another optimizer (sgd's momentum trace against adamw's moments) does not stop it."""
  source = template.get_config("size=tiny")
  source.optimizer.name = saved_optimizer
  trainer = Trainer(source, str(tmp_path / "source"))
  model_dict, optimizer_dict = trainer.split_pure(trainer.init_state())
  moved = lambda x: x + 5 if jnp.issubdtype(x.dtype, jnp.floating) else x  # a trained optimizer's values
  stored = checkpoints_lib.Checkpoints(str(tmp_path / "source"), keep=2)
  stored.save(3, jax.tree.map(jnp.ones_like, model_dict), jax.tree.map(moved, optimizer_dict),
              {"step": 3, "rng": [0, 7]})
  stored.close()
  config = template.get_config("size=tiny")  # adamw
  config.init_from = str(tmp_path / "source" / "checkpoints")
  state, step, _ = _restore(config, str(tmp_path / "run"))
  assert step == 0 and _all_ones(state)
  fresh = Trainer(config, str(tmp_path / "fresh"))
  want, got = (fresh.split_pure(s)[1] for s in (fresh.init_state(), state))
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_checkpoint_in_the_workdir_wins_over_init_from(saved_run, tmp_path):
  config, _, saved_workdir = saved_run
  config = config.copy_and_resolve_references()
  config.init_from = str(tmp_path / "elsewhere")  # never read: the workdir has a checkpoint
  state, step, key = _restore(config, saved_workdir)
  assert step == 3 and _all_ones(state)
  assert list(np.asarray(jax.random.key_data(key))) == [0, 7]  # the run's RNG comes back too


def _train_losses(workdir):
  rows = metrics_lib.read_metrics(str(workdir / "metrics.jsonl"))
  return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}


def test_a_fine_tuned_run_trains_on_exactly_once_the_run_it_started_from_is_gone(saved_run, tmp_path):
  """init_from is read at a fresh run's step 0 alone; the run's checkpoints hold the rest. A fine-tuned run could not
  be resumed (nor given more steps) once init_from's folder was moved or deleted: 'config.init_from=...: no such
  checkpoint directory', though nothing would have read it."""
  source = tmp_path / "source"
  shutil.copytree(saved_run[2], source)
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({
      "total_steps": 4, "steps_per_call": 2, "checkpoint.every_steps": 2, "eval_every_steps": 100,
      "batch_size": 8, "eval_batch_size": 8, "task.num_eval_examples": 8, "log_every_steps": 1,
      "model.dropout_rate": 0.1, "logging.tensorboard": False, "logging.plot": False,
      "init_from": str(source / "checkpoints")})
  loop.run(config.copy_and_resolve_references(), str(tmp_path / "whole"))
  shutil.copytree(tmp_path / "whole", tmp_path / "cut")
  shutil.rmtree(tmp_path / "cut" / "checkpoints" / "4")  # the run as a kill after its checkpoint at step 2 left it
  shutil.rmtree(source)
  with pytest.raises(validation.ConfigError, match=r"^config\.init_from=.*no such checkpoint directory"):
    loop.run(config.copy_and_resolve_references(), str(tmp_path / "fresh"))  # a fresh run still needs it
  loop.run(config.copy_and_resolve_references(), str(tmp_path / "cut"))
  assert checkpoints_lib.step_numbers(str(tmp_path / "cut")) == [2, 4]
  assert _train_losses(tmp_path / "cut") == _train_losses(tmp_path / "whole")  # steps 3 and 4 as they were


def test_without_checkpoints_training_starts_from_the_seed(saved_run, tmp_path):
  config, _, _ = saved_run
  state, step, _ = _restore(config, str(tmp_path))
  assert step == 0 and not _all_ones(state)


def test_a_saved_state_and_key_restore_as_they_were(saved_run, tmp_path):
  config, trainer, _ = saved_run
  state, key = trainer.init_state(), jax.random.key(11)
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=2)
  try:
    trainer.save(checkpoints, 5, state, key, {"eval/loss": 1.5})
    restored, step, restored_key = trainer.restore(checkpoints)
  finally:
    checkpoints.close()
  assert step == 5
  assert jax.random.key_data(restored_key).tolist() == jax.random.key_data(key).tolist()
  for a, b in zip(_float_leaves(trainer.split_pure(state)), _float_leaves(trainer.split_pure(restored))):
    np.testing.assert_array_equal(a, b)


def test_latest_state_without_a_checkpoint_is_a_run_error_naming_the_purpose(saved_run, tmp_path):
  _, trainer, _ = saved_run
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=2)
  try:
    with pytest.raises(RunError, match="no checkpoint in .* to eval with"):
      trainer.latest_state(checkpoints, "eval")
  finally:
    checkpoints.close()


class UnreadableDataTask(task_lib.Task):
  """A task whose data files cannot be read."""

  def __init__(self, config, workdir=None, mode="train"):
    raise ValueError("corpus.txt holds 3 lines,\n fewer than the vocabulary")


def test_a_task_that_cannot_build_its_data_is_a_one_line_data_error(tmp_path):
  config = template.get_config("size=tiny")
  config.task.name = f"{__name__}:UnreadableDataTask"
  with pytest.raises(DataError, match=r"cannot build its data: corpus.txt holds 3 lines, fewer than the vocabulary$"):
    Trainer(config, str(tmp_path))


class LoadedEmbeddingTask(template_task.TemplateTask):
  """The template task whose embedding table comes from "another run" (a fixed array): loaded_params."""
  TABLE = np.random.default_rng(0).standard_normal((template_task.VOCAB_SIZE, 16)).astype(np.float32)

  def make_model(self, rngs, *, dtype, param_dtype):
    model = super().make_model(rngs, dtype=dtype, param_dtype=param_dtype)
    model.embed.embedding[...] = self.TABLE
    return model

  def loaded_params(self):
    return {"embed": {"embedding": self.TABLE}}


def _constant_bytes(lowered) -> int:
  """Bytes of the non-splat constants of a lowered program."""
  return sum(len(blob) // 2 for blob in re.findall(r'dense<"0x([0-9A-F]+)">', lowered.as_text()))


def test_loaded_parameters_reach_the_init_program_as_arguments_not_constants(tmp_path):
  """Closed over, the table was compiled into the init program as a constant: compile time and memory that grow
  with a frozen model."""
  config = template.get_config("size=tiny")
  config.task.name = f"{__name__}:LoadedEmbeddingTask"
  config.model.d_model = 16
  trainer = Trainer(config, str(tmp_path))
  table = LoadedEmbeddingTask.TABLE
  assert _constant_bytes(trainer.init_program.lower(trainer.task.loaded_params())) < table.nbytes // 10
  closed_over = jax.jit(lambda: nnx.state(trainer.task.make_model(nnx.Rngs(0), dtype=jnp.float32,
                                                                  param_dtype=jnp.float32)))
  assert _constant_bytes(closed_over.lower()) >= table.nbytes  # what the check above would see
  model_dict, _ = trainer.split_pure(trainer.init_state())
  np.testing.assert_array_equal(model_dict["embed"]["embedding"], table)


def test_max_epochs_on_a_task_that_does_not_count_its_epochs_is_refused_before_anything_compiles(tmp_path):
  """The template task declares no steps_per_epoch: a data-sized budget cannot be honoured there."""
  config = template.get_config("size=tiny")
  config.max_epochs = 3.0
  with pytest.raises(validation.ConfigError, match=r"^config\.max_epochs=3\.0: task 'template' does not count"):
    Trainer(config, str(tmp_path))


def test_a_profile_window_past_where_max_epochs_ends_the_run_is_refused_before_anything_compiles(tmp_path,
                                                                                               monkeypatch):
  """Validation saw total_steps=100 as written; the passes ended the run at step 4, and it ended without a trace
  and without a word."""
  monkeypatch.setattr(template_task.TemplateTask, "steps_per_epoch", lambda self: 4)
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"total_steps": 100, "max_epochs": 1.0, "steps_per_call": 2,
                                     "profile.first_step": 40, "profile.num_steps": 2})
  validation.validate_config(config, workdir=str(tmp_path))
  with pytest.raises(validation.ConfigError, match=r"^config\.profile\.first_step=40: training ends at step 4, "
                                                   r"before it; use at most 2$"):
    Trainer(config, str(tmp_path))


# --- gradient accumulation (config.num_microbatches) ----------------------------------------------

_LM = ("--config=configs/lm_text.py:tokenizer=bytes", "--config.model.d_model=32", "--config.model.num_heads=2",
       "--config.model.num_layers=1", "--config.model.mlp_dim=64", "--config.model.max_length=64",
       "--config.data.sequence_length=32", "--config.batch_size=8", "--config.total_steps=4",
       "--config.steps_per_call=1", "--config.logging.tensorboard=False")
_TRANSLATOR = ("--config=configs/translate_dates.py:tokenizer=bytes", "--config.data.first_year=2000",
               "--config.data.last_year=2000", "--config.batch_size=8", "--config.total_steps=4",
               "--config.steps_per_call=1", "--config.model.dropout_rate=0.0", "--config.model.max_length=48",
               "--config.model.encoder.num_layers=1", "--config.model.decoder.num_layers=1",
               "--config.logging.tensorboard=False")


# Step 1 moves the parameters by the learning rate times the gradient: with Adam's first step (about the sign of
# each gradient) a gradient that is rounding noise (a key bias, which softmax ignores) would differ at random.
_PLAIN_UPDATE = ("--config.optimizer.name=sgd", "--config.optimizer.momentum=0", "--config.optimizer.warmup_steps=0",
                 "--config.optimizer.grad_clip_norm=0")


def _uneven_token_counts(batch):
  """The batch with microbatches of unequal token counts, and those token weights [B, T]."""
  batch = dict(batch)
  if batch.get("weights", np.zeros(())).ndim == 2:  # the LM's packed rows are nearly full: drop row 1's second
    batch["weights"] = batch["weights"].copy()       # half from the loss
    batch["weights"][1, batch["weights"].shape[1] // 2:] = 0
    return batch, np.asarray(batch["weights"], np.float32)
  return batch, np.asarray(batch["targets"] != 0, np.float32)  # padded targets: their tokens


def _step_metrics(args, workdir, microbatches=(1, 4), edit=lambda batch: batch):
  """[(train metrics of step 1, updated parameters)] of the config, its first batch (`edit`ed) run as each of
  `microbatches` (one Trainer: the task and its data are built once, each step program compiled for its K)."""
  from tests import helpers
  config = helpers.load_config(*args, *_PLAIN_UPDATE)
  validation.validate_config(config, mode="train", device_count=1)
  trainer = Trainer(config, str(workdir / "run"), "train")
  batch = trainer.batch(edit(trainer.read_train_batch(0)), config.batch_size, stacked=False)
  batch = jax.tree.map(lambda x: x[None], batch)
  results = []
  for count in microbatches:
    config.num_microbatches = count  # read by make_train_step
    state, metrics = trainer.make_train_step()(trainer.init_state(), batch, jnp.int32(0), jnp.int32(1),
                                               jax.random.key(config.seed))
    params = [x for x in jax.tree.leaves(state[0]) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    results.append(({name: float(value[0]) for name, value in metrics.items()}, params))
  return results


_TEMPLATE = ("--config=configs/template.py:size=tiny", "--config.batch_size=8", "--config.total_steps=4",
             "--config.steps_per_call=1", "--config.model.dropout_rate=0.0", "--config.logging.tensorboard=False")


_LM_ALGORITHMIC = ("--config=configs/lm_algorithmic.py:size=micro,operation=reverse", "--config.batch_size=8",
                   "--config.total_steps=4", "--config.steps_per_call=1", "--config.logging.tensorboard=False")


_ALGORITHMIC = ("--config=configs/algorithmic.py:size=micro,posenc=rope", "--config.batch_size=8",
                "--config.total_steps=4", "--config.steps_per_call=1", "--config.logging.tensorboard=False")


@pytest.mark.parametrize("args", [_LM, _TRANSLATOR, _TEMPLATE, _LM_ALGORITHMIC, _ALGORITHMIC],
                         ids=["lm", "translator", "template", "lm_algorithmic", "algorithmic"])
def test_microbatches_give_the_whole_batchs_loss_and_update(args, tmp_path):
  """Their loss sums and gradient sums add up, divided once by the whole batch's weight: the update of the
  whole batch. The microbatches here hold different numbers of tokens, so averaging their means would not."""
  tokens = {}

  def uneven(batch):
    batch, tokens["weights"] = _uneven_token_counts(batch)
    return batch

  (whole, params), (parts, params_k) = _step_metrics(args, tmp_path, edit=uneven)
  counts = [tokens["weights"][j::4].sum() for j in range(4)]
  assert len(set(counts)) > 1, counts  # (rows j, j + 4, ... form microbatch j)
  for metric in ("train/loss", "train/grad_norm"):
    assert parts[metric] == pytest.approx(whole[metric], rel=1e-5), metric
  for a, b in zip(params_k, params, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_microbatches_of_bfloat16_parameters_keep_the_optimizer_state_in_bfloat16_from_call_to_call(tmp_path):
  """The gradients added up over microbatches came back float32 for bfloat16 parameters: the optimizer's
  moments turned float32 within a step, and a call of several steps (a loop whose carry keeps its types) failed."""
  from tests import helpers
  config = helpers.load_config(*_TEMPLATE, "--config.precision.param_dtype=bfloat16", "--config.num_microbatches=2")
  validation.validate_config(config, mode="train", device_count=1)
  trainer = Trainer(config, str(tmp_path / "run"), "train")
  batches = jax.tree.map(lambda *x: np.stack(x), *(trainer.read_train_batch(step) for step in range(2)))
  batches = trainer.batch(batches, config.batch_size, stacked=True)
  state = trainer.init_state()
  dtypes = lambda tree: [x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  before = dtypes(state)
  assert jnp.bfloat16 in before
  state, metrics = trainer.make_train_step()(state, batches, jnp.int32(0), jnp.int32(2), jax.random.key(0))
  assert dtypes(state) == before
  assert np.all(np.isfinite(metrics["train/loss"])) and metrics["train/loss"].shape == (2,)


class _SumTask:
  """loss_terms alone: total = sum(x * w) over a microbatch's rows, so w's gradient is the sum of its x."""

  def loss_terms(self, model, rows, rngs):
    del rngs
    return jnp.sum(rows["x"] * model.w[...].astype(jnp.float32)), jnp.float32(rows["x"].shape[0]), {}


def test_microbatch_gradients_of_bfloat16_parameters_add_up_in_float32():
  """16 microbatches of one row: 256 then fifteen 1s. Added in bfloat16 (8 significant bits), each 1 rounds
  away against 256 and the mean reads 16; in float32 the sum is 271 and the mean 16.94, rounded once."""
  from xattn_jax.training.trainer import accumulated_gradients
  model = nnx.Module()
  model.w = nnx.Param(jnp.ones((1,), jnp.bfloat16))
  x = jnp.ones((16, 1), jnp.float32).at[0].set(256.0)
  (loss, grads), _ = accumulated_gradients(_SumTask(), model, {"x": x}, 16, jax.random.key(0), jnp.int32(0))
  assert grads["w"][...].dtype == jnp.bfloat16
  assert float(grads["w"][...][0]) == float(jnp.bfloat16(271.0 / 16))
  assert float(loss) == pytest.approx(271.0 / 16)


_QUICK_IMAGES = ("--config.batch_size=8", "--config.total_steps=4", "--config.steps_per_call=1",
                 "--config.logging.tensorboard=False", "--config.logging.plot=False")
# Beside train/loss, grad_norm and learning_rate: what each logs of its own
_IMAGE_TRAIN_METRICS = {"digits": {"accuracy", "tokens_handed_on"}, "segment": {"iou", "oracle_iou"},
                        "vlm_encoder": {"position_accuracy"}, "vlm_pairs_encoder": set(), "vlm": set()}


def _image_args(name, tmp_path):
  """Launch arguments of a task that logs its own train/<name> metrics beside the loss."""
  if name == "vlm":  # on the frozen parts of the session's tiny chain
    from tests.tasks import test_vlm
    chain = test_vlm.tiny_chain()
    frozen = {**test_vlm.TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm"}
    return ("--config=configs/vlm_digits.py:connector=qformer,queries=4",
            *(f"--config.{field}={value}" for field, value in frozen.items()), *_QUICK_IMAGES)
  from PIL import Image
  Image.fromarray(np.stack([np.full((12, 20), v, np.uint8) for v in (40, 160, 250)], axis=-1)).save(tmp_path / "a.png")
  Image.fromarray(np.eye(16, dtype=np.uint8) * 255).save(tmp_path / "b.png")
  (tmp_path / "pairs.tsv").write_text("a.png\ta dark box\nb.png\ta white line\n" * 4)
  pairs = (f"--config.data.train_file={tmp_path / 'pairs.tsv'}", f"--config.data.eval_file={tmp_path / 'pairs.tsv'}")
  return {
      "digits": ("--config=configs/perceiver_digits.py:steps=4,width=16,latents=4,blocks=1", *_QUICK_IMAGES),
      "segment": ("--config=configs/segment_digits.py", "--config.data.canvas=16", "--config.data.digit_size=8",
                  "--config.data.max_digits=2", "--config.model.d_model=16", "--config.model.num_heads=2",
                  "--config.model.num_blocks=1", "--config.model.mlp_dim=32", "--config.model.mask_features=8",
                  "--config.model.encoder.d_model=16", "--config.model.encoder.num_heads=2",
                  "--config.model.encoder.num_blocks=1", *_QUICK_IMAGES),
      "vlm_encoder": ("--config=configs/vlm_encoder.py:steps=4,width=16,blocks=1,patch=4,max_digits=2",
                      *_QUICK_IMAGES),
      "vlm_pairs_encoder": ("--config=configs/vlm_encoder.py:data=pairs,canvas=16x16,width=16,blocks=1,color=true",
                            *pairs, *_QUICK_IMAGES),  # RGB: the VLM chain test trains a grey one
  }[name]


@pytest.mark.parametrize("name", sorted(_IMAGE_TRAIN_METRICS))
def test_microbatches_of_the_image_tasks_give_the_whole_batchs_loss_update_and_train_metrics(name, tmp_path):
  """Their own train/<name> metrics (accuracy, IoU, ...) add up as (sum, weight) pairs as the loss does."""
  args = _image_args(name, tmp_path)
  (whole, params), (parts, params_k) = _step_metrics(args, tmp_path)
  own = {f"train/{metric}" for metric in _IMAGE_TRAIN_METRICS[name]}
  assert set(parts) == set(whole) == {"train/loss", "train/grad_norm", "train/learning_rate", *own}, whole
  assert whole["train/learning_rate"] > 0  # so that the parameters below moved
  # The segmenter thresholds its masks (its IoUs, and the IoU head's target inside its loss): float32's order of
  # additions flips the odd pixel whose mask logit sits within ~1e-6 of 0. A wrong sum over the microbatches moves
  # every metric far more than these bounds.
  loose = name == "segment"
  for metric, value in whole.items():
    rel, abs_ = ((0, 2e-3) if loose and "iou" in metric else (1e-4, 1e-6) if loose or metric == "train/grad_norm"
                 else (1e-5, 1e-6))
    assert parts[metric] == pytest.approx(value, rel=rel, abs=abs_), metric
  for a, b in zip(params_k, params, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_summary_counts_trainable_parameters_and_the_frozen_values_beside_them(tmp_path):
  """Logged when training starts: the connector's parameters against the frozen encoder's and LM's."""
  from tests import helpers
  args = _image_args("vlm", tmp_path)
  trainer = Trainer(helpers.load_config(*args), str(tmp_path / "vlm"), "train")
  model = trainer.model(trainer.abstract_state)  # shapes suffice: nothing is initialised or compiled
  sizes = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)
                          if jnp.issubdtype(x.dtype, jnp.floating))
  trainable = sizes(nnx.state(model, nnx.Param))
  frozen = sizes(nnx.state(model.encoder)) + sizes(nnx.state(model.lm))  # (RNG counters are integers: not counted)
  assert trainable and frozen
  summary = trainer.summary()
  assert f"Model: {trainable:,} trainable parameters" in summary, summary
  assert f"{frozen:,} other values not trained" in summary, summary
  assert "mesh data=1 x fsdp=1 x tensor=1 over 1 cpu device(s) in 1 process(es); global batch 8" in summary


class MeanOnlyTask(template_task.TemplateTask):
  """A task that gives its loss only as a mean (`loss`), as a user's task may."""
  loss_terms = task_lib.Task.loss_terms

  def loss(self, model, batch, *, rngs):
    logits, token_weights, loss_sum, weight_sum = self._token_losses(model, batch)
    return loss_sum / weight_sum, {}


class ExtraRowTask(template_task.TemplateTask):
  """A user's task whose train_batch keeps one row too many, and whose eval batches come as lists."""

  def train_batch(self, step, *, process_index, process_count):
    batch = super().train_batch(step, process_index=process_index, process_count=process_count)
    return {name: np.concatenate([rows, rows[:1]]) for name, rows in batch.items()}

  def eval_batches(self, *, process_index, process_count):
    for batch in super().eval_batches(process_index=process_index, process_count=process_count):
      yield list(batch.values())


class VectorLossTask(template_task.TemplateTask):
  """A user's task whose loss_terms sums over the batch only, leaving the positions axis; whose eval metrics are
  means, not (sum, weight) pairs; and whose infer_lines drops the last answer."""

  def loss_terms(self, model, batch, *, rngs):
    loss_sum, weight_sum, aux = super().loss_terms(model, batch, rngs=rngs)
    return loss_sum * jnp.ones(3), weight_sum, aux

  def eval_metrics(self, model, batch):
    return {name: total / weight for name, (total, weight) in super().eval_metrics(model, batch).items()}

  def infer_lines(self, model, lines):
    return super().infer_lines(model, lines)[:-1]


@pytest.mark.parametrize("microbatches, method", [(1, "loss"), (2, "loss_terms")])
def test_a_users_batches_and_loss_that_break_the_task_contract_are_named_in_one_line(tmp_path, microbatches, method):
  """A train batch of 33 rows for a batch_size of 32 ended in JAX's make_array_from_process_local_data error
  ("global_shape=(8, 32, 12) and local_data.shape=(8, 33, 12)"), a list of arrays in "list indices must be
  integers", a loss of shape (3,) in "Gradient only defined for scalar-output functions", eval means in "iteration
  over a 0-d array", one answer short in zip()'s "argument 2 is shorter than argument 1"."""
  config = template.get_config("size=tiny")
  config.task.name = "tests.training.test_trainer:ExtraRowTask"
  trainer = Trainer(config, str(tmp_path / "rows"), "train")
  with pytest.raises(RunError, match=re.escape("ExtraRowTask.train_batch(step 5) gave ['inputs'] of shape (33, 12): "
                                               "every array needs 32 rows on axis 0 (batch_size 32 over 1 process")):
    trainer.read_train_batch(5)
  with pytest.raises(RunError, match="ExtraRowTask.eval_batches gave a list: the Task contract asks for a dict"):
    trainer.evaluate(trainer.abstract_state)
  config.task.name = "tests.training.test_trainer:VectorLossTask"
  config.num_microbatches = microbatches
  trainer = Trainer(config, str(tmp_path / "loss"), "train")
  batch = trainer.batch(trainer.read_train_batch(0), config.batch_size, stacked=False)
  with pytest.raises(RunError, match=re.escape(f"VectorLossTask.{method} gave ") + "(the loss|loss_sum)" +
                     re.escape(" of shape (3,): needs a scalar")):
    jax.eval_shape(trainer.make_train_step(), trainer.abstract_state, jax.tree.map(lambda x: x[None], batch),
                   jnp.int32(0), jnp.int32(1), jax.random.key(0))
  if microbatches == 1:
    with pytest.raises(RunError, match=re.escape("VectorLossTask.eval_metrics gave 'loss' as an array of shape (): "
                                                 "the Task contract asks for a (sum, weight) pair of scalars")):
      trainer.evaluate(trainer.init_state())
    with pytest.raises(RunError, match=re.escape("VectorLossTask.infer_lines gave 1 answers for 2 lines: the Task "
                                                 "contract asks for one str per line")):
      trainer.task.infer(trainer.model(trainer.init_state()), ["abc", "", "ba"])


@pytest.mark.parametrize("overrides, device_count, message", [
    ({"num_microbatches": 2}, 1, "needs a task whose loss is a sum and a weight (Task.loss_terms); task "
                                 "'tests.training.test_trainer:MeanOnlyTask'"),
    ({"num_microbatches": 5}, 1, "must divide batch_size=12"),
    ({"num_microbatches": 0}, 1, "must be a positive integer"),
    ({"num_microbatches": 4}, 2, "leaves microbatches of 3 rows, not divisible by mesh data x fsdp = 2"),
])
def test_microbatches_a_task_or_batch_cannot_take_are_refused_in_one_line(overrides, device_count, message):
  from tests import helpers
  if "MeanOnlyTask" in message:
    config = template.get_config()
    config.task.name = "tests.training.test_trainer:MeanOnlyTask"
  else:  # a task that sums its loss
    config = helpers.load_config(*_LM, "--config.batch_size=12", "--config.eval_batch_size=12")
  config.num_microbatches = overrides["num_microbatches"]
  with pytest.raises(validation.ConfigError, match=rf"^config\.num_microbatches={config.num_microbatches}: "
                                                   rf"{re.escape(message)}"):
    validation.validate_config(config, mode="train", device_count=device_count)


def test_microbatches_hold_a_fraction_of_the_whole_batchs_temporaries(tmp_path):
  """What accumulation is for: XLA's temporaries of the step (activations, logits) at 4 microbatches are
  under half those of the whole batch (compiled, not run)."""
  from tests import helpers
  temporaries = []
  for microbatches in (1, 4):
    config = helpers.load_config(*_LM, "--config.batch_size=32", f"--config.num_microbatches={microbatches}")
    trainer = Trainer(config, str(tmp_path / f"k{microbatches}"), "train")
    batch = trainer.batch(trainer.read_train_batch(0), config.batch_size, stacked=False)
    compiled = trainer.make_train_step().lower(trainer.abstract_state, jax.tree.map(lambda x: x[None], batch),
                                               jnp.int32(0), jnp.int32(1), jax.random.key(0)).compile()
    temporaries.append(compiled.memory_analysis().temp_size_in_bytes)
  assert temporaries[1] < 0.5 * temporaries[0], temporaries


@pytest.mark.parametrize("total_steps, min_steps, bound", [(1000, 10, "the passes"), (100, 10, "total_steps"),
                                                           (30, 300, "total_steps, which comes before min_steps"),
                                                           (1000, 500, "min_steps")])
def test_the_end_step_line_says_which_bound_set_it(total_steps, min_steps, bound, caplog):
  """'Training ends at step 30: ... at least min_steps=300, at most total_steps=30' read as a contradiction."""
  from ml_collections import ConfigDict

  from xattn_jax.training import trainer as trainer_lib
  config = ConfigDict({"max_epochs": 2.0, "min_steps": min_steps, "total_steps": total_steps})
  task = type("Counted", (), {"steps_per_epoch": lambda self: 97})()
  with caplog.at_level(logging.INFO):
    sized = trainer_lib._sized_by_epochs(config, task)
  assert f"Training ends at step {sized.total_steps}, set by {bound}:" in caplog.text, caplog.text


class _TwoLayerTask:
  """make_model alone: a Linear in param_dtype beside a parameter the model keeps in float32."""

  def make_model(self, rngs, *, dtype, param_dtype):
    model = nnx.Module()
    model.linear = nnx.Linear(8, 8, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    model.scale = nnx.Param(jax.random.normal(rngs.params(), (8,), jnp.float32))
    return model


def test_bfloat16_parameters_start_from_the_float32_runs_weights_rounded():
  """param_dtype=bfloat16 drew its own bfloat16 random numbers: other weights than the float32 run's from the
  same seed (a first loss 0.4 apart on the tiny lm_algorithmic), so an ablation of param_dtype changed the init."""
  from xattn_jax.training.trainer import initial_model
  full = nnx.state(initial_model(_TwoLayerTask(), 3, dtype=jnp.float32, param_dtype=jnp.float32), nnx.Param)
  half = nnx.state(initial_model(_TwoLayerTask(), 3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), nnx.Param)
  assert half["linear"]["kernel"][...].dtype == jnp.bfloat16 and half["scale"][...].dtype == jnp.float32
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(half), strict=True):
    np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(jnp.asarray(a).astype(b.dtype), np.float32))
