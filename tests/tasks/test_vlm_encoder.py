"""The VLM's image encoder task (vlm_encoder): config checks before anything compiles, its batches, and a tiny
launch that learns to read digit strips."""
import jax
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from xattn_jax.data import vlm_digits
from xattn_jax.tasks.vlm import encoder
from xattn_jax.training import loop, task as task_lib, validation

TINY_ARG = "steps=120,width=32,blocks=1,patch=4,max_digits=2"
TINY = {"batch_size": 32, "eval_batch_size": 128, "log_every_steps": 40, "eval_every_steps": 120,
        "checkpoint.every_steps": 120, "logging.tensorboard": False, "logging.plot": False,
        "data.num_eval_strips": 256, "data.max_shift": 0, "optimizer.warmup_steps": 10}


def config(arg=TINY_ARG, **overrides):
  return helpers.load_config(f"--config=configs/vlm_encoder.py:{arg}",
                             *(f"--config.{k}={v}" for k, v in {**TINY, **overrides}.items()))


@pytest.fixture(scope="module")
def trained_encoder():
  """(workdir, its eval rows) of the tiny encoder (TINY_ARG's shapes) that the session's tiny VLM chain trained
  as its frozen encoder (tests/tasks/test_vlm.py)."""
  from tests.tasks.test_vlm import tiny_chain
  workdir = tiny_chain() / "encoder"
  return workdir, [row for row in helpers.metric_rows(workdir) if "eval/position_accuracy" in row]


def test_registered_as_vlm_encoder():
  assert task_lib.get_task_class("vlm_encoder") is encoder.StripEncoderTask


def test_default_config_validates():
  cfg = helpers.load_config("--config=configs/vlm_encoder.py")
  validation.validate_config(cfg, mode="train", device_count=1)
  encoder.StripEncoderTask.validate(cfg)
  assert encoder.canvas(cfg) == (8, 32) and cfg.model.grid == "4x16"


@pytest.mark.parametrize("overrides, field", [
    ({"model.grid": "2x2"}, "model.grid"), ({"model.patch_size": 3}, "model.patch_size"),
    ({"data.max_digits": 9}, "data.max_digits"), ({"data.scale": 0}, "data.scale"),
    ({"data.max_shift": 8}, "data.max_shift"), ({"task.label_smoothing": 1.0}, "task.label_smoothing"),
    ({"model.name": "perceiver"}, "model.name")])
def test_bad_config_raises_config_error_naming_the_field(overrides, field):
  with pytest.raises(validation.ConfigError) as caught:
    encoder.StripEncoderTask.validate(config(**overrides))
  assert caught.value.field == field


def test_a_bad_config_stops_the_run_before_anything_is_built(tmp_path):
  with pytest.raises(validation.ConfigError, match="model.grid"):
    loop.run(config(**{"model.grid": "2x2"}), str(tmp_path / "run"), "train")
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_rows_are_split_across_processes_as_the_global_batch():
  task = encoder.StripEncoderTask(config())
  whole = task.train_batch(3, process_index=0, process_count=1)
  halves = [task.train_batch(3, process_index=p, process_count=2) for p in range(2)]
  for key in whole:
    assert np.array_equal(whole[key], np.concatenate([h[key] for h in halves]))
  assert whole["images"].shape == (32, 8, 16, 1) and whole["labels"].shape == (32, 2)


def test_labels_name_each_position_and_empty_past_the_strip():
  task = encoder.StripEncoderTask(config())
  batch = task.train_batch(0, process_index=0, process_count=1)
  for image, labels in zip(batch["images"][..., 0], batch["labels"]):
    length = int(np.sum(labels != vlm_digits.EMPTY))
    assert length >= 1 and (labels[length:] == vlm_digits.EMPTY).all()
    assert not image[:, 8 * length:].any() and image[:, 8 * (length - 1):8 * length].any()


def test_eval_strips_are_made_of_test_digit_images():
  task = encoder.StripEncoderTask(config())
  images, labels = task.eval_set()
  test_images = {i.tobytes() for i in vlm_digits.source_digits()["test"][0]}
  for image, row in zip(images[..., 0], labels):
    for k in np.flatnonzero(row != vlm_digits.EMPTY):
      assert image[:, 8 * k:8 * (k + 1)].tobytes() in test_images


def test_position_logits_have_one_row_per_position():
  cfg = config()
  model = nnx.eval_shape(lambda: encoder.make_encoder(cfg.model, rngs=nnx.Rngs(0)))
  logits = nnx.eval_shape(lambda m, x: encoder.position_logits(m, x, position_width=8), model,
                          jax.ShapeDtypeStruct((3, 8, 16, 1), np.float32))
  assert logits.shape == (3, 2, vlm_digits.NUM_POSITION_CLASSES)


@pytest.mark.slow
def test_tiny_encoder_learns_to_read_test_strips(trained_encoder):
  _, rows = trained_encoder
  final = rows[-1]
  assert final["eval/position_accuracy"] > 0.3  # chance: 0.1
  assert final["eval/empty_accuracy"] > 0.95


@pytest.mark.slow
def test_infer_answers_each_line_with_the_digits_read(trained_encoder):
  model, task = loop.load_model(str(trained_encoder[0]))
  lines = task.infer(model, ["test:0", "test:1"])
  assert [line.split("\t")[0] for line in lines] == ["test:0", "test:1"]
  assert all(1 <= len(line.split("\t")[1].split()) <= 2 for line in lines)
