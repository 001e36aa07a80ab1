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


@pytest.mark.parametrize("split", vlm_digits.EVAL_SPLITS)
def test_eval_strips_are_made_of_the_eval_splits_digit_images(split):
  cfg = config()
  assert cfg.data.eval_split == "validation"  # the default: test only for a final score
  cfg.data.eval_split = split
  images, labels = encoder.StripEncoderTask(cfg).eval_set()
  split_images = {i.tobytes() for i in vlm_digits.source_digits()[split][0]}
  for image, row in zip(images[..., 0], labels):
    for k in np.flatnonzero(row != vlm_digits.EMPTY):
      assert image[:, 8 * k:8 * (k + 1)].tobytes() in split_images


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
  lines = task.infer(model, ["test:0", "validation:1"])
  assert [line.split("\t")[0] for line in lines] == ["test:0", "validation:1"]
  assert all(1 <= len(line.split("\t")[1].split()) <= 2 for line in lines)
  with pytest.raises(task_lib.InputLineError, match=r"validation:100000.*eval strips are 0\.\.\d+"):
    task.infer(model, ["validation:100000"])


# --- the encoder of a user's pairs (task vlm_pairs_encoder) ------------------------------------------------


def test_caption_words_vocabulary_and_targets():
  from xattn_jax.tasks.vlm import pairs_encoder
  texts = ["A big circle, on the left.", "a small square", "a circle left of a square"]
  assert pairs_encoder.caption_words(texts[0]) == ["a", "big", "circle", "on", "the", "left"]
  # counted once per caption ("a" twice in the third), commonest first, ties alphabetical, cut at size
  assert pairs_encoder.vocabulary(texts, 4) == ("a", "circle", "left", "square")
  targets = pairs_encoder.word_targets(texts, ("a", "circle", "left", "square"), 6)
  assert targets.shape == (3, 6) and targets[:, 4:].sum() == 0
  np.testing.assert_array_equal(targets[:, :4], [[1, 1, 1, 0], [1, 0, 0, 1], [1, 1, 1, 1]])
  # runs of adjacent words tell the order that the words alone cannot
  one, other = "a square left of a cross", "a cross left of a square"
  assert pairs_encoder.caption_terms(one, 1) == pairs_encoder.caption_terms(other, 1)
  assert pairs_encoder.caption_terms(one, 2) - pairs_encoder.caption_terms(other, 2) == {"square left"}
  assert pairs_encoder.vocabulary([one, other], 3, ngrams=2) == ("a", "a cross", "a square")


def test_caption_words_keep_combining_marks_and_split_scripts_written_without_spaces():
  """`\\w+` cut a Hindi word at each vowel sign and kept a Chinese caption whole: one term no other caption held."""
  from xattn_jax.tasks.vlm import pairs_encoder
  assert pairs_encoder.caption_words("हिन्दी भाषा") == ["हिन्दी", "भाषा"]
  assert pairs_encoder.caption_words("cafe\u0301 Caf\u00e9") == ["caf\u00e9", "caf\u00e9"]  # NFD and NFC: one word
  assert pairs_encoder.caption_words("黑猫の写真 ok") == ["黑", "猫", "の", "写", "真", "ok"]
  assert pairs_encoder.vocabulary(["一只黑猫", "两只黑猫"], 5, ngrams=2) == ("只", "只 黑", "猫", "黑", "黑 猫")
  assert "黑 猫" in pairs_encoder.caption_terms("一只黑猫", 2)


def _pairs_config(tmp_path, arg="data=pairs,canvas=16x16", **overrides):
  from PIL import Image
  Image.fromarray(np.full((12, 20), 40, np.uint8)).save(tmp_path / "a.png")
  (tmp_path / "pairs.tsv").write_text("a.png\ta dark box\n")
  return helpers.load_config(f"--config=configs/vlm_encoder.py:{arg}", *(
      f"--config.{k}={v}" for k, v in {"data.train_file": tmp_path / "pairs.tsv",
                                       "data.eval_file": tmp_path / "pairs.tsv", **overrides}.items()))


def test_pairs_of_one_image_without_an_eval_file_are_refused_in_one_line(tmp_path):
  """The held-out side of one image is empty: the run trained and logged an eval of nothing."""
  config = _pairs_config(tmp_path, **{"data.eval_file": ""})
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.data\.eval_file='': no eval pairs: .*pairs\.tsv shows one image"):
    validation.validate_config(config)


def test_the_pairs_encoder_config_validates_and_names_each_bad_field(tmp_path):
  from xattn_jax.tasks.vlm import pairs_encoder
  task_class = task_lib.get_task_class("vlm_pairs_encoder")
  assert task_class is pairs_encoder.CaptionWordsEncoderTask
  cfg = _pairs_config(tmp_path)
  validation.validate_config(cfg, mode="train", device_count=1)
  task_class.validate(cfg)
  assert encoder.canvas(cfg) == (16, 16) and cfg.model.grid == "4x4" and cfg.model.num_classes == 512
  assert _pairs_config(tmp_path, "data=pairs,canvas=32x24,patch=8").model.grid == "4x3"
  (tmp_path / "bad.tsv").write_text("a.png\ta dark box\nmissing.png\tnothing\n")
  for arg, overrides, field in [("data=pairs,canvas=16", {}, "data.canvas"),
                                ("data=pairs", {"data.canvas": ""}, "data.canvas"),  # was AttributeError 'max_digits'
                                ("data=pairs,canvas=16x0", {}, "data.canvas"),
                                ("data=pairs,canvas=18x18", {}, "model.patch_size"),
                                ("data=pairs", {"model.grid": "2x2"}, "model.grid"),
                                ("data=pairs", {"model.num_classes": 10}, "model.num_classes"),
                                ("data=pairs", {"data.train_file": ""}, "data.train_file"),
                                ("data=pairs", {"data.eval_file": tmp_path / "bad.tsv"}, "data.eval_file")]:
    with pytest.raises(validation.ConfigError) as caught:
      task_class.validate(_pairs_config(tmp_path, arg, **overrides))
    assert caught.value.field == field, (arg, overrides)
    if field == "data.eval_file":
      assert f"{tmp_path / 'bad.tsv'}:2" in str(caught.value)
  from configs import vlm_encoder as encoder_config
  with pytest.raises(ValueError, match="data='photos': allowed are \\['digits', 'pairs'\\]"):
    encoder_config.get_config("data=photos")


def test_the_pairs_encoder_shuffles_its_pairs_every_epoch_each_once(tmp_path):
  from PIL import Image
  from xattn_jax.tasks.vlm import pairs_encoder
  for n in range(10):  # image n is a flat grey of 12 (n + 1): its row of the batch says which pair it is
    Image.fromarray(np.full((16, 16), 12 * (n + 1), np.uint8)).save(tmp_path / f"{n}.png")
  (tmp_path / "ten.tsv").write_text("".join(f"{n}.png\tword{n}\n" for n in range(10)))
  cfg = _pairs_config(tmp_path, **{"data.train_file": tmp_path / "ten.tsv", "batch_size": 4})
  task = pairs_encoder.CaptionWordsEncoderTask(cfg, None, "train")
  def pair_of(image):
    return int(round(image.mean() * 255 / 12)) - 1

  def pairs(step):
    return [pair_of(image) for image in task.train_batch(step, process_index=0, process_count=1)["images"]]
  first_epoch = pairs(0) + pairs(1) + pairs(2)[:2]
  assert sorted(first_epoch) == list(range(10)) and first_epoch != list(range(10))
  assert sorted(pairs(2)[2:] + pairs(3) + pairs(4)) == list(range(10))
  batch = task.train_batch(0, process_index=0, process_count=1)
  for image, targets in zip(batch["images"], batch["targets"]):  # each row's targets are its own caption's word
    assert task.words[int(np.argmax(targets))] == f"word{pair_of(image)}" and targets.sum() == 1


def test_the_pairs_encoder_reads_colour_only_when_asked(tmp_path):
  cfg = _pairs_config(tmp_path, "data=pairs,canvas=16x16,color=true")
  task_lib.get_task_class("vlm_pairs_encoder").validate(cfg)
  assert cfg.data.color and cfg.model.channels == 3
  with pytest.raises(validation.ConfigError) as caught:
    task_lib.get_task_class("vlm_pairs_encoder").validate(_pairs_config(tmp_path, "data=pairs,color=true",
                                                                        **{"model.channels": 1}))
  assert caught.value.field == "model.channels"


@pytest.mark.slow
def test_a_colour_encoder_tells_red_from_green_where_grey_cannot(tmp_path):
  """Red (255, 0, 0) and green (0, 130, 0) are the same grey (76): only the RGB encoder can name them."""
  from PIL import Image
  for name, rgb in (("red", (255, 0, 0)), ("green", (0, 130, 0))):
    pixels = np.full((16, 16, 3), 255, np.uint8)
    pixels[4:12, 4:12] = rgb
    Image.fromarray(pixels).save(tmp_path / f"{name}.png")
  (tmp_path / "train.tsv").write_text("red.png\ta red square\ngreen.png\ta green square\n" * 16)
  (tmp_path / "eval.tsv").write_text("red.png\ta red square\ngreen.png\ta green square\n")
  f1 = {}
  for colour in ("false", "true"):
    workdir = tmp_path / f"colour_{colour}"
    result = helpers.launch(f"configs/vlm_encoder.py:data=pairs,canvas=16x16,color={colour},steps=60,width=32,"
                            "blocks=1,warmup=5", workdir, overrides={
                                "data.train_file": tmp_path / "train.tsv", "data.eval_file": tmp_path / "eval.tsv",
                                "batch_size": 8, "eval_batch_size": 8, "log_every_steps": 20})
    assert result.returncode == 0, result.stderr[-2000:]
    f1[colour] = [row for row in helpers.metric_rows(workdir) if "eval/word_f1" in row][-1]["eval/word_f1"]
  # 5 terms a caption ("a", "square", the colour and its two word pairs), 3 of them the colour's. The two pictures
  # are one grey picture, so the best a grey encoder can do is name every term of both captions (F1 10/13, 0.77)
  assert f1["true"] > 0.95 and f1["false"] < 0.8, f1


def test_a_pairs_encoder_run_made_before_colour_and_word_runs_still_loads(tmp_path):
  """Runs written before data.color, data.ngrams and model.channels read as grey, words alone, one channel."""
  from xattn_jax.tasks.vlm import pairs_encoder
  cfg = _pairs_config(tmp_path)
  with cfg.unlocked():
    del cfg.data["color"], cfg.data["ngrams"], cfg.model["channels"]
  task_lib.get_task_class("vlm_pairs_encoder").validate(cfg, mode="eval")
  task = pairs_encoder.CaptionWordsEncoderTask(cfg, None, "eval")
  assert task.ngrams == 1 and encoder.grey(cfg) and task.words == ("a", "box", "dark")
  assert encoder.make_encoder(cfg.model, rngs=nnx.Rngs(0)).embed.in_features == 16  # 4 x 4 patches, 1 channel


def test_the_held_out_side_of_a_pairs_file_opens_only_its_own_images(tmp_path, monkeypatch):
  """Without a data.eval_file, an eval (of the VLM, the encoder) decoded every training image of
  data.train_file to keep the 5% it held out."""
  from PIL import Image
  from xattn_jax.data import image_text
  for n in range(60):
    Image.fromarray(np.full((8, 8), 3 * n, np.uint8)).save(tmp_path / f"img{n}.png")
  (tmp_path / "train.tsv").write_text("".join(f"img{n}.png\tcaption {n}\n" for n in range(60)))
  held = sorted(image_text.held_out_pairs(tmp_path / "train.tsv"))
  opened = []
  load_image = image_text.load_image
  monkeypatch.setattr(image_text, "load_image", lambda path, *a, **k: opened.append(path) or load_image(path, *a, **k))
  pairs_config = helpers.load_config("--config=configs/vlm_encoder.py:data=pairs,canvas=16x16",
                                     f"--config.data.train_file={tmp_path / 'train.tsv'}")
  evaluated = encoder.read_pairs_field(pairs_config, "data.eval_file")
  assert [e.targets()[0] for e in evaluated] == [f"caption {n}" for n in held]
  assert sorted(opened) == sorted(str(tmp_path / f"img{n}.png") for n in held)
  opened.clear()
  assert len(encoder.read_pairs_field(pairs_config, "data.train_file")) == 60 - len(held)
  assert len(opened) == 60 - len(held)
