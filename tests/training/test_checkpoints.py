"""Checkpoint retention (last K plus the best), the step a run hands on, and the mismatch report, in process."""
import json
import time

import jax
import jax.numpy as jnp
import pytest

from xattn_jax.training import checkpoints as checkpoints_lib


def _tiny(step):
  return {"w": jnp.full((3,), float(step))}, {"count": jnp.asarray(step)}


def test_keeps_the_last_k_plus_the_best_by_the_eval_metric(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=2, best_metric="eval/loss", best_mode="min")
  losses = {1: 3.0, 2: 0.5, 3: 2.0, 4: 1.0, 5: 1.5}
  for step, loss in losses.items():
    model, optimizer = _tiny(step)
    checkpoints.save(step, model, optimizer, {"step": step}, {"eval/loss": loss})
  assert checkpoints.steps() == [2, 4, 5]
  checkpoints.close()


def test_best_mode_max_keeps_the_highest_metric(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/accuracy", best_mode="max")
  for step, accuracy in {1: 0.2, 2: 0.9, 3: 0.4}.items():
    model, optimizer = _tiny(step)
    checkpoints.save(step, model, optimizer, {"step": step}, {"eval/accuracy": accuracy})
  assert checkpoints.steps() == [2, 3]
  checkpoints.close()


@pytest.mark.parametrize("mode, values, min_delta", [
    ("max", [0.5, 1.0, 1.0, 1.0, 0.9], 0.0),  # a tie: the first to reach 1.0
    ("min", [3.0, 2.0, 2.0, 1.99, 2.5], 0.1),  # a gain under min_delta: still the best eval
    ("min", [2.0, 2.0, 2.0], 0.0),
])
def test_the_best_checkpoint_is_the_eval_early_stopping_names_best(tmp_path, mode, values, min_delta):
  """orbax alone keeps the latest of equal values, early stopping named the first: early_stop.json said 'best at
  step 10' and checkpoint.eval_from=best read step 30."""
  from ml_collections import ConfigDict

  from xattn_jax.training import guards
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/m", best_mode=mode)
  watcher = guards.EarlyStopping(ConfigDict({"early_stopping": {"patience": 100, "min_delta": min_delta},
                                             "checkpoint": {"best_metric": "eval/m", "best_mode": mode}}))
  for i, value in enumerate(values):
    step = 10 * (i + 1)
    checkpoints.save(step, *_tiny(step), {"step": step}, {"eval/m": value})
    watcher.after_eval(step, {"eval/m": value})
  assert checkpoints.best_step() == watcher.best_step
  assert checkpoints.steps() == sorted({watcher.best_step, 10 * len(values)})
  checkpoints.close()
  resumed = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/m", best_mode=mode)
  assert resumed.best_step() == watcher.best_step  # the step is stored with the metrics
  resumed.close()


@pytest.mark.parametrize("mode, values, improving", [
    ("min", [3.0, 2.0, 2.0, 2.5, 1.0], [True, True, False, False, True]),  # a tie is no gain
    ("max", [0.5, 0.4, 0.9], [True, False, True])])
def test_an_eval_improves_on_the_best_only_where_it_beats_every_kept_step(tmp_path, mode, values, improving):
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/m", best_mode=mode)
  assert not checkpoints.improves_on_best({"eval/other": 1.0}) and not checkpoints.improves_on_best(None)
  for step, (value, expected) in enumerate(zip(values, improving), 1):
    assert checkpoints.improves_on_best({"eval/m": value}) is expected, step
    checkpoints.save(step, *_tiny(step), {"step": step}, {"eval/m": value})
  checkpoints.close()


def test_an_eval_between_checkpoint_steps_that_beats_the_best_is_saved_so_eval_from_best_reads_it(tmp_path):
  """early_stop.json named the best eval's step, but eval_from=best read the best among the checkpoint steps
  alone: an eval between them that beat it had no checkpoint (a README trial: best at 200, read 400)."""
  from configs import template
  from xattn_jax.training import loop
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({  # the worst loss ranks best here: the first eval, step 2, between saves
      "total_steps": 6, "log_every_steps": 2, "eval_every_steps": 2, "checkpoint.every_steps": 6,
      "checkpoint.best_metric": "eval/loss", "checkpoint.best_mode": "max", "eval_batch_size": 8,
      "task.num_eval_examples": 8, "optimizer.warmup_steps": 1, "logging.tensorboard": False,
      "logging.plot": False})
  loop.run(config, str(tmp_path))
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  losses = {row["step"]: row["eval/loss"] for row in rows if "eval/loss" in row}
  best = max(losses, key=lambda step: (losses[step], -step))
  assert best == 2, losses  # the model learns: its first eval's loss is the highest
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/loss", best_mode="max")
  assert best in checkpoints.steps() and checkpoints.best_step() == best
  assert checkpoints_lib.steps_to_read(checkpoints, "best") == [best]
  checkpoints.close()


def test_the_best_checkpoint_survives_a_resume(tmp_path):
  """A resumed run (a new manager on the same directory) still knows the earlier steps' metrics:
  they were kept only in memory, and the first save after a resume deleted the best step."""
  first = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/exact_match", best_mode="max")
  for step, metrics in ((200, {"eval/exact_match": 0.9}), (232, None)):  # 232: saved on Ctrl-C, no eval
    first.save(step, *_tiny(step), {"step": step}, metrics)
  first.close()
  resumed = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/exact_match", best_mode="max")
  for step in (300, 350, 400):
    resumed.save(step, *_tiny(step), {"step": step}, {"eval/exact_match": 0.5} if step % 100 == 0 else None)
  assert resumed.steps() == [200, 400]
  resumed.close()


def test_a_read_only_manager_leaves_a_save_in_progress_alone(tmp_path):
  """Eval and infer open the checkpoints read-only: a training run's save in progress (orbax's temporary folder)
  stays, where a training manager removes it as a leftover; removing it failed that run's save."""
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=2)
  checkpoints.save(100, *_tiny(100), {"step": 100})
  checkpoints.close()
  in_progress = tmp_path / "checkpoints" / "200.orbax-checkpoint-tmp"
  (in_progress / "model.orbax-checkpoint-tmp").mkdir(parents=True)
  reader = checkpoints_lib.Checkpoints(str(tmp_path), keep=2, read_only=True)
  assert reader.steps() == [100]
  time.sleep(1.0)  # orbax removes leftovers in a thread of its own
  reader.close()
  assert in_progress.is_dir()
  trainer = checkpoints_lib.Checkpoints(str(tmp_path), keep=2)
  trainer.save(300, *_tiny(300), {"step": 300})  # a save waits for that removal
  trainer.close()
  assert not in_progress.exists()


def test_a_mismatch_names_a_parameter_before_an_rng_counter(tmp_path):
  """A deeper stack differs in its per-layer RNG counts too; 'blocks.dropout.rngs.count is [2]' was
  reported instead of the parameter whose shape tells why."""
  import orbax.checkpoint as ocp
  stored = {"blocks": {"dropout": {"rngs": {"count": jnp.zeros((2,), jnp.uint32)}}, "kernel": jnp.zeros((2, 8))}}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "model", stored)
  wanted = jax.eval_shape(lambda: {"blocks": {"dropout": {"rngs": {"count": jnp.zeros((1,), jnp.uint32)}},
                                              "kernel": jnp.zeros((1, 8))}})
  assert checkpoints_lib.model_mismatch(str(tmp_path / "model"), wanted) == \
      "parameter blocks.kernel is [2, 8] in the checkpoint, [1, 8] in this config"


def _run_config(tmp_path, **checkpoint):
  (tmp_path / "config.json").write_text(json.dumps({"checkpoint": checkpoint}))


def test_a_runs_result_is_its_newest_step_or_its_best_as_its_eval_from_says(tmp_path):
  """What a run hands on to a run that freezes it: the checkpoint its own --mode=eval reads."""
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=5, best_metric="eval/loss", best_mode="min")
  for step, loss in {10: 2.0, 20: 0.5, 30: 1.0}.items():
    checkpoints.save(step, *_tiny(step), {"step": step}, {"eval/loss": loss})
  checkpoints.close()
  _run_config(tmp_path, eval_from="latest", best_metric="eval/loss", best_mode="min")
  assert checkpoints_lib.result_step(str(tmp_path)) == 30
  _run_config(tmp_path, eval_from="best", best_metric="eval/loss", best_mode="min")
  assert checkpoints_lib.result_step(str(tmp_path)) == 20
  _run_config(tmp_path, eval_from="best", best_metric="eval/loss", best_mode="max")
  assert checkpoints_lib.result_step(str(tmp_path)) == 10


def test_a_step_named_by_its_number_is_read_if_kept_and_refused_naming_the_kept_ones_if_not(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=5, best_metric="eval/loss")
  for step in (10, 20, 30):
    checkpoints.save(step, *_tiny(step), {"step": step}, {"eval/loss": 1.0})
  assert checkpoints_lib.steps_to_read(checkpoints, "20") == [20]
  assert checkpoints_lib.steps_to_read(checkpoints, "latest") is None
  with pytest.raises(checkpoints_lib.RunError, match=r"eval_from='25': no checkpoint at step 25 .* keeps steps \[10, "
                                                     r"20, 30\]"):
    checkpoints_lib.steps_to_read(checkpoints, "25")
  checkpoints.close()
  _run_config(tmp_path, eval_from="10", best_metric="eval/loss", best_mode="min")
  assert checkpoints_lib.result_step(str(tmp_path)) == 10


def test_a_best_result_without_ranked_checkpoints_is_refused(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=5)
  checkpoints.save(10, *_tiny(10), {"step": 10})
  checkpoints.close()
  _run_config(tmp_path, eval_from="best", best_metric="eval/loss", best_mode="min")
  with pytest.raises(checkpoints_lib.RunError, match="eval_from='best'"):
    checkpoints_lib.result_step(str(tmp_path))
  _run_config(tmp_path, eval_from="latest", best_metric="eval/loss", best_mode="min")
  assert checkpoints_lib.result_step(str(tmp_path)) == 10



def _listed_then_deleted(tmp_path):
  """A read-only manager (eval, infer) that lists step 2, which a run training with checkpoint.keep=1 then deletes
  on saving step 4: the window between choosing a step and restoring it."""
  abstract = jax.eval_shape(lambda: _tiny(0))
  training = checkpoints_lib.Checkpoints(str(tmp_path), keep=1)
  training.save(2, *_tiny(2), {"step": 2})
  reader = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, read_only=True)
  assert reader.steps() == [2]
  training.save(4, *_tiny(4), {"step": 4})
  training.close()
  assert checkpoints_lib.step_numbers(str(tmp_path)) == [4]
  return reader, abstract


def test_a_newest_step_deleted_while_being_read_gives_way_to_the_newest_kept_one(tmp_path):
  """An eval started beside training read a step the training run's retention deleted, and failed with 'no
  checkpoint could be read' while a newer one was there."""
  reader, abstract = _listed_then_deleted(tmp_path)
  model, _, meta = reader.restore_latest(*abstract, quarantine=False)
  reader.close()
  assert meta["step"] == 4 and float(model["w"][0]) == 4.0


def test_a_chosen_step_deleted_while_being_read_is_named_with_the_reason_and_the_kept_steps(tmp_path):
  reader, abstract = _listed_then_deleted(tmp_path)
  with pytest.raises(checkpoints_lib.RunError, match=r"^checkpoint step 2 in \S+ was deleted while it was being "
                                                     r"read, by the retention \(checkpoint.keep\) of a run training "
                                                     r"in the workdir; it keeps steps \[4\] now"):
    reader.restore_latest(*abstract, steps=[2], quarantine=False)
  reader.close()


_SAVE_OVER_TWO_DEVICES = """
import sys, jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
mesh = jax.make_mesh((2,), ("data",))
w = jax.device_put(jnp.arange(8.0).reshape(4, 2), jax.sharding.NamedSharding(mesh, jax.P("data")))
with ocp.StandardCheckpointer() as checkpointer:
  checkpointer.save(sys.argv[1] + "/3/model", {"w": w})
"""


def test_a_model_saved_over_other_devices_is_read_onto_this_ones(tmp_path):
  """A VLM's frozen LM trained over 2 CPU devices could not be read by a process with 1 (orbax: 'Topology
  mismatch ... provide a target tree with the desired topology')."""
  import sys  # noqa: PLC0415
  from tests import helpers  # noqa: PLC0415
  saved = helpers.run([sys.executable, "-c", _SAVE_OVER_TWO_DEVICES, str(tmp_path)],
                      env=helpers.subprocess_env(device_count=2), timeout=120)
  assert saved.returncode == 0, saved.stderr[-2000:]
  restored = checkpoints_lib.restore_model_from(str(tmp_path), {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)})
  assert jnp.array_equal(restored["w"], jnp.arange(8.0).reshape(4, 2))


def test_a_failed_reads_message_keeps_tensorstores_reason_without_its_spec_dump():
  """A damaged checkpoint's log line and RunError carried tensorstore's whole store spec (a JSON dump of thousands
  of characters ending in a bound method's repr) after the reason."""
  reason = ('OUT_OF_RANGE: Error reading "w/.zarray": Requested byte range [0, 2588) is not valid for value of '
            'size 862')
  spec = ' [tensorstore_spec=\'{"driver":"zarr","kvstore":{"path":"/run/checkpoints/4/model/"}}\'] [tensorstore_spec[1]'
  error = ValueError(reason + spec + " See full TensorStore details: <bound method X of Y>\nsecond line")
  assert checkpoints_lib.short_error(error) == f"ValueError: {reason}"
  assert checkpoints_lib.short_error(KeyError()) == "KeyError: "
