"""Tiny digit configs run end to end through launch.py (subprocesses, a few steps each), and the digits
task's config checks (in-process, no training)."""
import json
import os
import shutil
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.image
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from flax import nnx

from tests import helpers

from xattn_jax.data import digits
from xattn_jax.models import latent_reader
from xattn_jax.tasks.digits import common as digits_common, qformer as qformer_task, task as digits_task
from xattn_jax.tasks.digits import vit as vit_task
from xattn_jax.training import dependencies, loop, task as task_lib, validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = ["--config.log_every_steps=2", "--config.eval_every_steps=4", "--config.checkpoint.every_steps=4",
         "--config.logging.tensorboard=false", "--config.logging.plot=false", "--config.eval_batch_size=180"]
PERCEIVER = ["--config=configs/perceiver_digits.py:steps=4,width=16,latents=4,blocks=1",
             "--config.data.extra_eval_grids=12x12", "--config.task.num_attention_images=1", *QUICK]


def launch(*args, workdir, stdin=None, cwd=ROOT):
  done = helpers.run([sys.executable, os.path.join(ROOT, "launch.py"), f"--workdir={workdir}", *args], cwd=cwd,
                     input=stdin, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def checkpoint_parameters(workdir):
  """{path: array} of the floating-point arrays (the parameters, not RNG state) of the newest checkpoint."""
  directory = os.path.join(workdir, "checkpoints")
  step = max(int(name) for name in os.listdir(directory) if name.isdigit())
  with ocp.StandardCheckpointer() as checkpointer:
    tree = checkpointer.restore(os.path.join(directory, str(step), "model"))
  flat = {}

  def walk(node, prefix):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(value, f"{prefix}{key}/")
      elif jnp.issubdtype(value.dtype, jnp.floating):
        flat[f"{prefix}{key}"] = np.asarray(value)

  walk(tree, "")
  return flat


@pytest.fixture(scope="module")
def perceiver_workdir(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("perceiver"))
  launch(*PERCEIVER, workdir=workdir)
  return workdir


@pytest.fixture(scope="module")
def qformer_workdirs(tmp_path_factory):
  """(encoder workdir, Q-Former workdir): trained from the directory above them, named relative to it."""
  root = tmp_path_factory.mktemp("qformer")
  launch(f"--config={ROOT}/configs/qformer_digits.py:steps=4,queries=4,encoder=vit",
         "--config.model.encoder_config=configs/vit_digits.py:steps=4,width=16,blocks=1",
         "--config.model.d_model=16", "--config.model.num_blocks=2", "--config.task.num_attention_images=0",
         "--config.data.extra_eval_grids=", *QUICK, workdir="qformer", cwd=root)
  return str(root / "vit"), str(root / "qformer")


@pytest.mark.slow
def test_perceiver_config_trains_and_logs_eval_on_a_resized_grid(perceiver_workdir):
  last = metrics(perceiver_workdir)[-1]
  assert last["step"] == 4
  assert {"eval/accuracy", "eval/accuracy_12x12", "train/loss"} <= set(last)
  assert last["train/tokens_handed_on"] == 4


@pytest.mark.slow
def test_perceiver_eval_draws_each_querys_attention(perceiver_workdir):
  # training evaluates on the validation split; its images are the ones drawn
  assert os.path.getsize(os.path.join(perceiver_workdir, "attention_maps", "validation_0.png")) > 1000


@pytest.mark.slow
def test_infer_classifies_npy_and_png_files(perceiver_workdir, tmp_path):
  split = digits.load_digits_split()
  np.save(tmp_path / "one.npy", split.test_images[0] * 16)  # on the data set's own 0..16 scale
  np.save(tmp_path / "stack.npy", split.test_images[:3])
  matplotlib.image.imsave(tmp_path / "two.png", 1.0 - split.test_images[1], cmap="gray", vmin=0, vmax=1)
  names = [str(tmp_path / "one.npy"), str(tmp_path / "stack.npy"), str(tmp_path / "two.png"), "test:5"]
  output = launch(*PERCEIVER, "--mode=infer", workdir=perceiver_workdir, stdin="\n".join(names) + "\n")
  lines = output.strip().splitlines()
  assert [line.split("\t")[0] for line in lines] == names
  assert [len(line.split("\t")[1].split()) for line in lines] == [1, 3, 1, 1]
  assert all(0 <= int(p) <= 9 for line in lines for p in line.split("\t")[1].split())


@pytest.mark.slow
def test_infer_refuses_an_image_with_nan_pixels_naming_it(perceiver_workdir, tmp_path):
  image = digits.load_digits_split().test_images[0].copy()
  image[3, 4] = np.nan  # classified as some digit before
  np.save(tmp_path / "nan.npy", image)
  model, task = loop.load_model(str(perceiver_workdir))
  with pytest.raises(task_lib.InputLineError, match=r"input line 2: .*nan\.npy' holds NaN or infinite pixel values"):
    task.infer(model, ["test:0", str(tmp_path / "nan.npy")])
  with pytest.raises(task_lib.InputLineError, match=r"input line 1: 'test:abc': the test set has images 0\.\."):
    task.infer(model, ["test:abc"])
  # every bad line in one go, not the first alone (a missing file after the NaN one)
  with pytest.raises(task_lib.InputLineError) as error:
    task.infer(model, [str(tmp_path / "nan.npy"), "test:0", "", str(tmp_path / "missing.png")])
  assert [index for index, _ in error.value.problems] == [0, 3], error.value.problems


@pytest.mark.slow
def test_qformer_config_trains_its_missing_encoder_first(qformer_workdirs):
  encoder, workdir = qformer_workdirs
  assert metrics(encoder)[-1]["step"] == 4
  assert metrics(workdir)[-1]["train/tokens_handed_on"] == 4


@pytest.mark.slow
def test_qformer_training_leaves_the_encoder_bit_for_bit_as_trained(qformer_workdirs):
  encoder, workdir = qformer_workdirs
  trained = checkpoint_parameters(encoder)
  inside = {k[len("encoder/"):]: v for k, v in checkpoint_parameters(workdir).items() if k.startswith("encoder/")}
  assert set(inside) == set(trained)
  for key, value in trained.items():
    np.testing.assert_array_equal(inside[key], value, err_msg=key)


@pytest.mark.slow
def test_eval_metric_names_are_what_eval_logs(perceiver_workdir):
  logged = {name for name in metrics(perceiver_workdir)[-1] if name.startswith("eval/")}
  assert logged == set(digits_common.EVAL_METRICS) | {"eval/accuracy_12x12"}
  assert all(name in digits_task.DigitsTask.eval_metric_names for name in logged)


def _tree(directory):
  return sorted(os.path.relpath(os.path.join(parent, name), directory)
                for parent, folders, files in os.walk(directory) for name in folders + files)


@pytest.mark.slow
def test_qformer_infer_from_another_directory_reads_no_encoder_run(qformer_workdirs, tmp_path, monkeypatch):
  encoder, workdir = qformer_workdirs
  lines = [f"test:{k}" for k in range(8)]
  encoder_files = _tree(encoder)
  monkeypatch.chdir(os.path.dirname(workdir))  # where it was trained: model.encoder_workdir="vit" is there
  model, task = loop.load_model("qformer")
  expected = task.infer(model, lines)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  output = launch(f"--config={workdir}/config.py", "--mode=infer", workdir=workdir, cwd=elsewhere,
                  stdin="\n".join(lines) + "\n")
  assert output.strip().splitlines() == expected
  monkeypatch.chdir(elsewhere)
  model, task = loop.load_model(workdir)
  assert task.infer(model, lines) == expected
  assert os.listdir(elsewhere) == []  # no encoder trained at elsewhere/vit
  assert _tree(encoder) == encoder_files


@pytest.mark.slow
def test_qformer_eval_reads_only_its_record_and_checkpoint(qformer_workdirs, tmp_path, monkeypatch):
  """A copy of the Q-Former run evaluates with its encoder run out of reach: the record names a missing
  workdir, and model.encoder_workdir ("vit") does not exist from here."""
  _, workdir = qformer_workdirs
  copy = tmp_path / "qformer"
  shutil.copytree(workdir, copy)
  record = json.loads((copy / qformer_task.ENCODER_RECORD).read_text())
  (copy / qformer_task.ENCODER_RECORD).write_text(json.dumps({**record, "encoder_workdir": str(tmp_path / "gone")}))
  monkeypatch.chdir(tmp_path)
  config = validation.load_config_file(str(copy / "config.py"))
  assert dependencies.resolve(config, str(copy), "eval") == []
  values = loop.run(config, str(copy), "eval")
  assert 0.0 <= values["eval/accuracy"] <= 1.0
  assert sorted(os.listdir(tmp_path)) == ["qformer"]


# --- config checks: in-process, before anything is built ---------------------------------------------


def digits_config(name, arg="", **overrides):
  """configs/<name>_digits.py[:arg] with `--config.a.b=v` style overrides (keys with "__" for ".")."""
  config = validation.load_config_file(os.path.join(ROOT, "configs", f"{name}_digits.py"), arg or None)
  for key, value in overrides.items():
    *parents, field = key.split("__")
    node = config
    for parent in parents:
      node = node[parent]
    node[field] = value
  return config


def config_error(config, mode="train"):
  """The field of the ConfigError that validation raises (its message a single line), or None."""
  try:
    validation.validate_config(config, mode=mode)
  except validation.ConfigError as error:
    assert "\n" not in str(error)
    return error.field
  return None


@pytest.fixture
def qformer(tmp_path):
  """Q-Former config overrides whose encoder is still to be trained (from configs/vit_digits.py, 2x2 patches)."""
  return {"model__encoder_workdir": str(tmp_path / "no_encoder_yet")}


@pytest.mark.parametrize("split, count", [("validation", 150), ("test", 361), ("test", 1000), ("validation", -1)])
def test_num_attention_images_must_fit_the_eval_split(split, count):  # 149 validation, 360 test images
  config = digits_config("perceiver", task__num_attention_images=count, data__eval_split=split)
  assert config_error(config) == "task.num_attention_images"


@pytest.mark.parametrize("fraction, error", [(0.999, True), (0.005, True), (0.0056, False), (0.994, False)])
def test_test_fraction_must_leave_every_class_on_both_sides(fraction, error):
  """0.999 reached scikit-learn, whose stratified split failed with a message naming no field."""
  config = digits_config("perceiver", data__test_fraction=fraction, task__num_attention_images=0,
                         data__validation_fraction=0.0, data__eval_split="test")
  assert config_error(config) == ("data.test_fraction" if error else None)


def test_num_attention_images_may_draw_every_eval_image_or_none():
  for split, count in (("validation", 0), ("validation", 149), ("test", 360)):
    assert config_error(digits_config("perceiver", task__num_attention_images=count, data__eval_split=split)) is None
  small_test = {"data__test_fraction": 0.02, "data__eval_split": "test"}
  assert config_error(digits_config("perceiver", task__num_attention_images=36, **small_test)) is None
  assert config_error(digits_config("perceiver", task__num_attention_images=37, **small_test)) == \
      "task.num_attention_images"


@pytest.mark.parametrize("overrides, field", [
    ({"data__eval_split": "train"}, "data.eval_split"),
    ({"data__validation_fraction": 0.0}, "data.validation_fraction"),       # eval_split="validation": none held out
    ({"data__validation_fraction": 1.0}, "data.validation_fraction"),
    ({"data__validation_fraction": True}, "data.validation_fraction"),
    ({"data__validation_fraction": 0.994, "data__eval_split": "test"}, "data.validation_fraction"),  # no train
    ({"data__validation_fraction": 0.0, "data__eval_split": "test"}, None),
    ({"data__validation_fraction": 0.5}, None),
])
def test_the_eval_split_and_validation_fraction_are_checked_before_training(overrides, field):
  assert config_error(digits_config("perceiver", task__num_attention_images=0, **overrides)) == field


def test_a_config_from_before_the_validation_split_keeps_its_old_split():
  """A run's config.py written before the fields existed trained on all 1,437 non-test images and evaluated on
  test: reloaded, it still does (resume and --mode=eval read the run it made)."""
  config = digits_config("perceiver", task__num_attention_images=0)
  with config.unlocked():
    del config.data["eval_split"], config.data["validation_fraction"]
  assert config_error(config) is None
  task = task_lib.get_task_class(config.task.name)(config)
  assert len(task.split.train_labels) == 1437 and task.eval_split == "test" and len(task.eval_labels) == 360


@pytest.mark.parametrize("split, size", [("validation", 149), ("test", 360)])
def test_eval_reads_every_image_of_the_configured_split_once(split, size):
  config = digits_config("perceiver", data__eval_split=split, task__num_attention_images=0)
  task = task_lib.get_task_class(config.task.name)(config)
  batches = list(task.eval_batches(process_index=0, process_count=1))
  weights = np.concatenate([b["weights"] for b in batches])
  labels = np.concatenate([b["labels"] for b in batches])[weights > 0]
  images = np.concatenate([b["images"] for b in batches])[weights > 0, ..., 0]
  expected_images, expected_labels = task.split.side(split)
  assert weights.sum() == size
  np.testing.assert_array_equal(labels, expected_labels)
  np.testing.assert_allclose(images, task.split.standardize(expected_images))


def test_attention_maps_drawn_with_a_lower_count_leave_no_earlier_maps_of_that_split_behind(tmp_path, monkeypatch):
  """An eval with task.num_attention_images lowered kept the earlier eval's higher-numbered maps, which looked
  current; another split's maps are another eval's and stay."""
  from xattn_jax.tasks.digits import plots as digits_plots  # noqa: PLC0415
  config = digits_config("perceiver", task__num_attention_images=1)
  task = task_lib.get_task_class(config.task.name)(config)
  monkeypatch.setattr(type(task), "query_attention", lambda self, model, images: (np.full((len(images), 1, 2, 64),
                                                                                          1 / 64), 1))
  monkeypatch.setattr(digits_plots, "plot_query_attention", lambda image, maps, path, title: open(path, "w").close())
  for name in ("validation_0.png", "validation_1.png", "validation_2.png", "test_2.png"):
    (tmp_path / name).write_bytes(b"earlier eval")
  assert task.write_attention_maps(None, str(tmp_path)) == [str(tmp_path / "validation_0.png")]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["test_2.png", "validation_0.png"]
  assert (tmp_path / "validation_0.png").read_bytes() == b""  # drawn again


@pytest.mark.parametrize("field, value", [("data__grid", "9x9"), ("data__grid", "8x9"),
                                          ("data__extra_eval_grids", "12x12,9x9")])
def test_qformer_grids_must_split_into_the_encoders_patches(qformer, field, value):
  expected = field.replace("__", ".")
  assert config_error(digits_config("qformer", **qformer, **{field: value})) == expected


def test_qformer_grid_check_reads_the_patch_of_the_declared_encoder_config(qformer):
  encoder = {"model__encoder_config": "configs/vit_digits.py:patch=4"}
  assert config_error(digits_config("qformer", **qformer, **encoder, data__extra_eval_grids="12x12,16x16")) is None
  assert config_error(digits_config("qformer", **qformer, **encoder, data__extra_eval_grids="12x12,10x10")) == \
      "data.extra_eval_grids"
  assert config_error(digits_config("qformer", **qformer, data__extra_eval_grids="12x12,10x10")) is None  # 2x2


def test_qformer_refuses_an_encoder_run_made_with_another_config_naming_the_field(qformer):
  """A ViT run of 4x4 patches where the declared encoder config has 2x2 ones: refused before any training."""
  encoder_workdir = qformer["model__encoder_workdir"]
  os.makedirs(os.path.join(encoder_workdir, "checkpoints", "2000"))
  with open(os.path.join(encoder_workdir, "config.json"), "w") as f:
    f.write(digits_config("vit", "patch=4").to_json())
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.encoder_config='configs/vit_digits\.py': "
                     r"its model\.grid='4x4', but the run in .* was made with '2x2'"):
    dependencies.resolve(digits_config("qformer", **qformer), None)


def test_qformer_task_loads_its_encoder_and_never_trains_it(qformer, tmp_path):
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.encoder_workdir=.* holds no finished encoder run"):
    digits_task.DigitsTask(digits_config("qformer", **qformer), str(tmp_path / "qformer"), "train")
  assert not os.path.exists(qformer["model__encoder_workdir"])


@pytest.mark.parametrize("name", ["vit", "perceiver", "qformer"])
def test_the_digits_task_is_the_task_of_its_model_family(name, qformer):
  config = digits_config(name, **(qformer if name == "qformer" else {}))
  assert digits_task.DigitsTask.dependencies(config, None) == digits_task.MODELS[name].dependencies(config, None)
  assert bool(digits_task.DigitsTask.dependencies(config, None)) == (name == "qformer")
  if name != "qformer":  # the Q-Former's needs its encoder run (above)
    assert type(digits_task.DigitsTask(config)) is digits_task.MODELS[name]


@pytest.mark.parametrize("connector", sorted(qformer_task.CONNECTORS))
def test_each_connector_reports_the_tokens_it_hands_on(connector):
  encoder = digits_config("vit", "width=16,blocks=1")
  model = latent_reader.QFormer(vit_task.make_vit(encoder.model, rngs=nnx.Rngs(0)), num_classes=10,
                                connector=connector, num_queries=3, width=16, num_heads=2, num_blocks=2,
                                rngs=nnx.Rngs(1))
  images = jnp.zeros((2, 12, 12, 1))
  handed_on = nnx.eval_shape(lambda m, x: m.tokens(x), model, images).shape[1]  # shapes only: nothing compiles
  assert qformer_task.CONNECTORS[connector].tokens_handed_on(model, images) == handed_on


@pytest.mark.parametrize("name", ["perceiver", "vit", "qformer"])
@pytest.mark.parametrize("smoothing", [1.0, 1.5, -0.1])
def test_label_smoothing_must_be_in_zero_to_one(qformer, name, smoothing):
  overrides = qformer if name == "qformer" else {}
  assert config_error(digits_config(name, **overrides, task__label_smoothing=smoothing)) == "task.label_smoothing"


@pytest.mark.parametrize("name, arg", [("vit", ""), ("perceiver", "patch=0"), ("vit", "patch=0"),
                                       ("perceiver", "patch=-2")])
def test_a_patch_size_below_one_names_its_field(name, arg):
  config = digits_config(name, arg)
  if not arg:
    config.model.patch_size = 0
  assert config_error(config) == "model.patch_size"


def test_max_shift_cannot_move_a_digit_off_the_canvas():  # a shift by (4, 4) can (test_digits_data.py)
  assert config_error(digits_config("perceiver", data__max_shift=3)) is None
  for shift in (4, 7, 20):
    assert config_error(digits_config("perceiver", data__max_shift=shift)) == "data.max_shift"


@pytest.mark.parametrize("best, field", [("eval/los", "checkpoint.best_metric"),
                                         ("eval/accuracy_20x20", "checkpoint.best_metric"),
                                         ("eval/accuracy_HxW", "checkpoint.best_metric"),
                                         ("eval/loss", None), ("eval/accuracy_16x16", None), ("", None)])
def test_best_metric_must_be_one_that_eval_logs(best, field):
  assert config_error(digits_config("vit", checkpoint__best_metric=best)) == field
