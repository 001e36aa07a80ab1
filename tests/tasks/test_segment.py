"""The promptable segmentation task: config checks (in-process), one tiny launch that learns, and its
inference (in-process, from the run's workdir) on a PNG with clicks and a box."""
import shutil

import matplotlib

matplotlib.use("Agg")
import matplotlib.image
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from xattn_jax.tasks.segment import task as segment_task
from xattn_jax.training import inference, task as task_lib, validation, workdir as workdir_lib
from xattn_jax.training.errors import RunError

CONFIG = "configs/segment_digits.py"
# A tiny model on 16x16 canvases of two 8x8 digits: M = 16 features, one two-way block, 200 steps.
TINY = {"total_steps": 200, "batch_size": 16, "eval_batch_size": 48, "log_every_steps": 25,
        "eval_every_steps": 200, "checkpoint.every_steps": 200, "logging.tensorboard": False, "logging.plot": False,
        "optimizer.warmup_steps": 20, "optimizer.learning_rate": 5e-3, "data.canvas": 16, "data.digit_size": 8,
        "data.max_digits": 2, "model.d_model": 32, "model.num_heads": 2, "model.num_blocks": 1, "model.mlp_dim": 64,
        "model.mask_features": 8, "model.encoder.d_model": 32, "model.encoder.num_heads": 2,
        "model.encoder.num_blocks": 1, "task.num_eval_scenes": 16, "task.num_plot_examples": 2}


@pytest.fixture(scope="session")
def trained_segmenter():
  def build(workdir):
    result = helpers.launch(CONFIG, workdir, overrides=TINY)
    assert result.returncode == 0, result.stderr[-3000:]
  return helpers.build_once("trained_segmenter", build)


def _config(**overrides):
  config = helpers.load_config(f"--config={CONFIG}")
  with config.unlocked():
    for field, value in overrides.items():
      node = config
      *parents, leaf = field.split(".")
      for part in parents:
        node = node[part]
      node[leaf] = value
  return config


@pytest.mark.slow
def test_a_tiny_run_learns_to_segment_the_prompted_digit(trained_segmenter):
  rows = helpers.metric_rows(trained_segmenter)
  final = [row for row in rows if "eval/box_mean_iou" in row][-1]
  # Untrained, the best of the three masks has IoU ~0.12 with the target here; a mask of all the ink
  # ~0.53. The tiny run gets to about the latter (telling the prompted digit apart takes the default
  # config's size and steps: README).
  assert final["eval/box_mean_iou"] > 0.35 and final["eval/click_mean_iou"] > 0.35
  assert -1.0 <= final["eval/iou_head_pearson"] <= 1.0
  assert {f"eval/{name}" for name in segment_task.METRIC_NAMES} <= set(final)
  assert (trained_segmenter / "segment_plots" / "validation_1.png").is_file()  # training evaluates on validation


@pytest.mark.slow
def test_infer_writes_a_mask_png_for_clicks_on_an_image_file(trained_segmenter, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained_segmenter, workdir)  # infer writes its PNGs into the workdir
  image = np.zeros((16, 16))
  image[4:12, 6:9] = 1.0  # a bar, clicked on its stroke at column 7, row 8
  matplotlib.image.imsave(tmp_path / "bar.png", image, cmap="gray")
  model, task = inference.load_model(str(workdir))
  bar, spaced = str(tmp_path / "bar.png"), str(tmp_path / "my bar.png")
  shutil.copyfile(bar, spaced)  # a path with a space takes a tab before its prompt
  lines = task.infer(model, [f"{bar} 7,8", "test:1", f"{bar} box=6,4,9,12", f"{bar} 7,8 2,2,-", f"{spaced}\t7,8"])
  assert [line.split("\t")[0] for line in lines] == [bar, "test:1", bar, bar, spaced]
  for line in lines:
    name, png, iou, pixels = line.split("\t")
    assert png.startswith(str(workdir / "infer")) and matplotlib.image.imread(png).ndim == 3
    assert 0.0 <= float(iou.removeprefix("iou=")) <= 1.0 and int(pixels.removeprefix("pixels=")) >= 0
  _, again = task.infer(model, ["", f"{bar} 7,8"])  # line 2 after a blank line, the name of the first's line 1
  assert [line.split("\t")[1].rsplit("/", 1)[1] for line in lines] == ["bar_1.png", "test_1_2.png", "bar_3.png",
                                                                       "bar_4.png", "my_bar_5.png"]
  assert again.split("\t")[1] == str(workdir / "infer" / "bar_2.png")  # its own line's number, not its place
  [third] = task.infer(model, [f"{bar} 7,8"])  # the same name again: the first infer's picture is kept
  assert third.split("\t")[1] == str(workdir / "infer" / "bar_1-2.png")


@pytest.mark.slow
def test_infer_refuses_a_click_outside_the_image_naming_the_line(trained_segmenter, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(trained_segmenter, workdir)
  model, task = inference.load_model(str(workdir))
  with pytest.raises(task_lib.InputLineError, match="outside") as error:
    task.infer(model, ["test:0", "test:0 99,3"])
  assert error.value.index == 1
  # a number like 1.2.3 was Python's "could not convert string to float"; a path with a space its first word
  with pytest.raises(task_lib.InputLineError, match="'1.2.3,4' is no click: write x,y"):
    task.infer(model, ["test:0 1.2.3,4"])
  with pytest.raises(task_lib.InputLineError, match="no such file 'my'; a path holding spaces takes a tab"):
    task.infer(model, ["my scan.png 8,6"])
  assert len(task.infer(model, ["test:0 .5,3.", "test:0 box=1,2,10.5,12"])) == 2


@pytest.mark.parametrize("field, value", [
    ("data.digit_size", 40), ("data.min_digits", 5), ("data.threshold", 16.0), ("model.patch_size", 5),
    ("model.d_model", 68), ("model.fourier_scale", 0.0), ("task.prompt_mix.scribble", 1.0),
    ("task.prompt_mix.box", -1.0), ("task.num_masks", 0), ("model.name", "unet"), ("task.iou_loss_weight", -1.0),
    ("task.all_masks_loss_weight", -0.5), ("data.eval_split", "train"), ("data.validation_fraction", 1.0),
    ("data.validation_fraction", 0.0), ("data.validation_fraction", 0.999),
    # infinite ones were accepted: an inf loss weight or Fourier scale trains on NaN, an inf prompt weight draws
    # from NaN probabilities; a NaN prompt weight was named as the whole task.prompt_mix
    ("model.fourier_scale", float("inf")), ("task.iou_loss_weight", float("inf")),
    ("task.all_masks_loss_weight", float("inf")), ("task.prompt_mix.box", float("inf")),
    ("task.prompt_mix.click", float("nan"))])
def test_a_bad_config_field_is_refused_by_name_before_anything_builds(field, value):
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(_config(**{field: value}))
  assert error.value.field == field


@pytest.mark.parametrize("scenes, plots, most", [(200, 101, 100), (200, 10**6, 100), (3, 7, 6)])
def test_num_plot_examples_is_bounded_by_a_page_of_pngs_and_by_the_eval_prompts(scenes, plots, most):
  """A huge value drew every eval prompt's PNG at every eval (num_eval_scenes=5000: 10,000 or more)."""
  config = _config(**{"task.num_eval_scenes": scenes, "task.num_plot_examples": plots})
  with pytest.raises(validation.ConfigError, match=rf"^config\.task\.num_plot_examples={plots}: must be in "
                     rf"\[0, {most}\]: each eval draws them anew"):
    validation.validate_config(config)
  validation.validate_config(_config(**{"task.num_eval_scenes": scenes, "task.num_plot_examples": most}))


def test_a_prompt_mix_of_zeros_is_refused():
  config = _config(**{f"task.prompt_mix.{kind}": 0.0 for kind in ("click", "clicks", "box", "ambiguous")})
  with pytest.raises(validation.ConfigError, match="task.prompt_mix"):
    validation.validate_config(config)


def test_the_default_config_is_valid_and_its_best_metric_is_logged():
  config = _config()
  validation.validate_config(config)
  assert config.checkpoint.best_metric in segment_task.SegmentTask.eval_metric_names


@pytest.mark.parametrize("field, value, trained", [("data.canvas", 32, 16), ("task.num_masks", 5, 3)])
def test_eval_and_infer_refuse_the_canvas_or_mask_count_the_run_was_not_trained_with(tmp_path, field, value, trained):
  """Both build the parameters (the encoder's patch grid, the mask tokens): a changed one reached orbax's shape
  check, which named a parameter, not the field."""
  workdir_lib.write_config(_config(**TINY), str(tmp_path))
  (tmp_path / "checkpoints" / "200").mkdir(parents=True)
  workdir_lib.check_same_model(_config(**{**TINY, "task.num_eval_scenes": 8}), str(tmp_path), mode="eval")
  for mode in ("eval", "infer"):
    with pytest.raises(validation.ConfigError, match=rf"^config\.{field}={value}: the run in .* was made with "
                       rf"{trained}; {mode} reads the model as it was trained: keep it$"):
      workdir_lib.check_same_model(_config(**{**TINY, field: value}), str(tmp_path), mode=mode)


def test_eval_reads_the_configured_splits_prompts_and_test_k_always_the_tests():
  tiny = {"data.canvas": 16, "data.digit_size": 8, "data.max_digits": 2, "task.num_eval_scenes": 4}
  validation_task = segment_task.SegmentTask(_config(**tiny))
  test_task = segment_task.SegmentTask(_config(**tiny, **{"data.eval_split": "test"}))
  assert not np.array_equal(validation_task.eval_set["images"], test_task.eval_set["images"])
  np.testing.assert_array_equal(validation_task.prompts("test")["images"], test_task.eval_set["images"])
  # the pools hold disjoint source images: no digit of validation or test is a training digit
  pools = validation_task.pools
  train = {bytes(pixels) for pixels in pools["train"].pixels}
  assert not any(bytes(pixels) in train for name in ("validation", "test") for pixels in pools[name].pixels)


def test_a_config_from_before_the_validation_split_keeps_its_old_split():
  config = _config(**{"data.canvas": 16, "data.digit_size": 8, "data.max_digits": 2, "task.num_eval_scenes": 4})
  with config.unlocked():
    del config.data["eval_split"], config.data["validation_fraction"]
  validation.validate_config(config)
  task = segment_task.SegmentTask(config)
  assert task.eval_split == "test" and len(task.pools["validation"].labels) == 0
  np.testing.assert_array_equal(task.eval_set["images"], task.prompts("test")["images"])


def _untrained(workdir=None, mode="train"):
  """(task, model) of a tiny untrained segmenter on 8x8 canvases, built in-process."""
  import jax.numpy as jnp
  tiny = {"data.canvas": 8, "data.digit_size": 8, "data.min_digits": 1, "data.max_digits": 2,
          "task.num_eval_scenes": 3, "model.d_model": 8, "model.num_heads": 1, "model.num_blocks": 1,
          "model.mlp_dim": 8, "model.mask_features": 4, "model.patch_size": 4, "model.encoder.d_model": 8,
          "model.encoder.num_heads": 1, "model.encoder.num_blocks": 1}
  task = segment_task.SegmentTask(_config(**tiny), workdir and str(workdir), mode)
  return task, task.make_model(nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)


def test_eval_metrics_sum_to_the_same_means_whatever_the_eval_batch_size():
  task, model = _untrained()
  metrics = nnx.jit(lambda model, batch: task.eval_metrics(model, batch))
  examples = task.eval_set
  kinds = examples["kinds"]
  assert 0 < np.sum(kinds == 3) < len(kinds)  # some rows ambiguous, some not

  def means(rows_per_batch):
    totals = {}
    for start in range(0, len(kinds), rows_per_batch):
      batch = {key: value[start:start + rows_per_batch] for key, value in examples.items()}
      for name, (total, weight) in metrics(model, batch).items():
        totals[name] = np.add(totals.get(name, 0.0), (float(total), float(weight)))
    return {name: total / max(weight, 1e-12) for name, (total, weight) in totals.items()}

  # a batch without an ambiguous prompt counted as one, and pulled eval/ambiguous_both_iou down
  whole, single = means(len(kinds)), means(1)
  assert whole.keys() == single.keys()
  for name in whole:
    np.testing.assert_allclose(single[name], whole[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_min_digits_that_never_fit_the_canvas_are_refused_by_name():
  # a 12x12 canvas holds one 12x12 digit: every scene held one, whatever data.min_digits said
  with pytest.raises(validation.ConfigError, match="none of 20 scenes fits 2 digits") as error:
    segment_task.SegmentTask(_config(**{"data.canvas": 12, "task.num_eval_scenes": 4}))
  assert error.value.field == "data.min_digits"
  segment_task.SegmentTask(_config(**{"data.canvas": 12, "data.min_digits": 1, "task.num_eval_scenes": 4}))


def test_infer_names_data_max_clicks_for_too_many_clicks_and_refuses_an_empty_image(tmp_path):
  task = segment_task.SegmentTask(_config(**{"data.canvas": 16, "data.digit_size": 8, "data.max_digits": 2,
                                             "task.num_eval_scenes": 4}), mode="infer")
  np.save(tmp_path / "scan.npy", np.zeros((8, 8)))
  np.save(tmp_path / "empty.npy", np.zeros((0, 5)))
  with pytest.raises(ValueError, match=r"4 clicks: a prompt holds at most 3 \(data.max_clicks=3; "
                                       r"--config.data.max_clicks=4 takes more"):
    task._read_line(f"{tmp_path / 'scan.npy'} 1,1 2,2 3,3 4,4")
  with pytest.raises(ValueError, match=r"holds no pixels \(shape \[0, 5\]\)"):
    task._read_line(f"{tmp_path / 'empty.npy'} 0,0")
  assert task._read_line(f"{tmp_path / 'scan.npy'} 1,1 2,2 3,3")[2].shape == (3, 2)


def test_infer_into_a_workdir_it_cannot_draw_in_is_refused_before_predicting(tmp_path):
  """The PNGs come after the prediction: a run on read-only storage failed there, in a traceback."""
  task = segment_task.SegmentTask(_config(**{"data.canvas": 16, "data.digit_size": 8, "data.max_digits": 2,
                                             "task.num_eval_scenes": 4}), mode="infer")
  np.save(tmp_path / "scan.npy", np.zeros((8, 8)))
  (tmp_path / "infer").write_text("")  # where the answers' folder would be
  task.workdir = str(tmp_path)
  with pytest.raises(RunError, match=r"draws each answer into .*infer, which cannot be made \(File exists\)"):
    task.infer_lines(None, [f"{tmp_path / 'scan.npy'} 1,1"])  # no model: refused before it is needed


def test_scenes_without_overlapping_digits_are_said_to_have_no_ambiguous_prompts(caplog):
  tiny = {"data.canvas": 16, "data.digit_size": 8, "data.max_digits": 2, "task.num_eval_scenes": 4}
  segment_task.SegmentTask(_config(**tiny))
  assert "share a pixel" not in caplog.text
  segment_task.SegmentTask(_config(**tiny, **{"data.min_visible": 1.0}))
  assert "None of 20 scenes has digits that share a pixel (data.min_visible=1" in caplog.text


def test_infer_names_a_png_after_a_long_image_name_within_the_file_systems_limit(tmp_path):
  # a 251-letter name made a 257-byte PNG name: OSError, and every other line's answer was lost
  task, model = _untrained(tmp_path, mode="infer")
  image = tmp_path / ("b" * 251 + ".npy")
  np.save(image, np.zeros((8, 8)))
  first, second = task.infer(model, ["test:0", f"{image} 1,1"])
  assert first.split("\t")[1].endswith("test_0_1.png")
  assert second.split("\t")[1] == str(tmp_path / "infer" / ("b" * 48 + "_2.png"))


def test_a_prediction_titled_in_a_script_no_font_draws_warns_of_no_missing_glyph(tmp_path):
  """infer titles each picture with its input line's image path: a Chinese file name on a machine without a CJK
  font drew empty boxes with one matplotlib "Glyph ... missing" warning per distinct character."""
  import warnings

  from xattn_jax.tasks.segment import plots
  image = np.zeros((8, 8), np.float32)
  masks = np.zeros((2, 8, 8), bool)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plots.plot_prediction(image, np.array([[0.5, 0.5]]), np.array([1]), masks, np.array([0.3, 0.6]),
                          str(tmp_path / "p.png"), title="扫描/猫的照片.png")
  assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert [str(w.message) for w in caught if "missing from" in str(w.message)] == []


def test_a_prediction_titled_with_dollar_signs_is_drawn_as_text(tmp_path):
  """A file name holding '$^$' raised matplotlib's mathtext ParseSyntaxException: infer stopped."""
  from xattn_jax.tasks.segment import plots
  plots.plot_prediction(np.zeros((8, 8), np.float32), np.array([[0.5, 0.5]]), np.array([1]), np.zeros((2, 8, 8), bool),
                        np.array([0.3, 0.6]), str(tmp_path / "p.png"), title="scan$^$1.png")
  assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
