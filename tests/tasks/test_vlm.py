"""The VLM task: config errors before anything compiles, a user's bad pairs file refused by file:line, and a
tiny chain (encoder, LM, connector) that learns."""
import json
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from PIL import Image

from configs import vlm_digits as vlm_digits_config
from tests import helpers
from xattn_jax.data import tokenizers, vlm_digits
from xattn_jax.models import connectors, vit, vlm
from xattn_jax.tasks.vlm import distillation, frozen as vlm_frozen, probe, task as vlm_task
from xattn_jax.training import checkpoints, dependencies, distributed, task as task_lib, validation
from xattn_jax.training.errors import RunError

TINY_CHAIN = {
    # the encoder the vlm_encoder tests read too: strips of up to 2 digits, 4 x 4 patches (2 x 4 per canvas)
    "model.encoder_config": "configs/vlm_encoder.py:steps=120,width=32,blocks=1,patch=4,max_digits=2,warmup=10",
    "model.lm_config": "configs/vlm_lm.py:steps=30,size=micro",
    "data.max_digits": 2, "data.num_train_examples": 200, "data.num_eval_examples": 16, "batch_size": 16,
    "eval_batch_size": 16, "log_every_steps": 10,
}


def tiny_chain() -> pathlib.Path:
  """A folder with encoder/, lm/ and vlm/: one launch of a llava connector (60 steps on the count questions)
  whose frozen encoder and LM the launcher trained first, as their workdirs held no run. Built once per
  test session (tests of the encoder task read encoder/); tests must not write into it."""
  def build(directory):
    overrides = {**TINY_CHAIN, "model.encoder_workdir": directory / "encoder", "model.lm_workdir": directory / "lm"}
    # in turn: the two missing runs train in this launch's process, not in two fresh interpreters side by side
    # (half the build's CPU time; the same runs: test_dependencies.py's
    # test_missing_dependencies_train_side_by_side_in_subprocesses_as_the_runs_trained_in_turn)
    result = helpers.launch("configs/vlm_digits.py:connector=llava,steps=60,lr=0.003,kinds=count",
                            directory / "vlm", "--dependencies=in_turn", overrides=overrides, timeout=900)
    if result.returncode:
      raise RuntimeError(f"the tiny VLM chain failed (exit {result.returncode}): {result.stderr[-3000:]}")
  return helpers.build_once("vlm_tiny_chain", build)


def config_error_field(*argv):
  """The field named by the ConfigError that validation raises, or None."""
  config = helpers.load_config(*argv)
  try:
    validation.validate_config(config, mode="train")
  except validation.ConfigError as error:
    return str(error).split("=", 1)[0]
  return None


@pytest.mark.parametrize("argument,field", [
    ("--config.model.connector=mlp", "config.model.connector"),
    ("--config.model.image_positions=mrope", "config.model.image_positions"),  # flamingo has no soft tokens
    ("--config.model.feature_positions=rope_2d", "config.model.feature_positions"),  # rotary: not added
    ("--config.model.spatial_merge=2", "config.model.spatial_merge"),  # flamingo hands the LM no patches
    ("--config.model.spatial_merge=0", "config.model.spatial_merge"),
    ("--config.data.kinds=caption,colour", "config.data.kinds"),
    ("--config.data.max_digits=3", "config.data.max_digits"),  # not the frozen encoder's canvas
    ("--config.data.scale=2", "config.data.scale"),  # the frozen encoder reads digits at scale 1
    ("--config.data.scale=0", "config.data.scale"),
    ("--config.task.decoding.method=nucleus", "config.task.decoding.method"),
    ("--config.task.distill_weight=-1.0", "config.task.distill_weight"),
    ("--config.data.eval_split=train", "config.data.eval_split"),  # evaluating on training examples
    ("--config.data.train_file=pairs.tsv", "config.data.train_file"),  # ignored by the strips: trained on them
])
def test_a_bad_config_field_is_named_before_anything_compiles(argument, field):
  assert config_error_field("--config=configs/vlm_digits.py", argument) == field


@pytest.mark.parametrize("arguments, message", [
    # flamingo's gated blocks attend at the frozen LM's width (128), its resampler at the encoder's (64)
    (("connector=flamingo", "--config.model.num_heads=3"),
     r"^config\.model\.num_heads=3: must divide the frozen LM's model\.d_model, 128 \(configs/vlm_lm\.py\)"),
    (("connector=flamingo", "--config.model.num_heads=3", "--config.model.num_latents=0"),
     r"^config\.model\.num_heads=3: must divide the frozen LM's model\.d_model, 128"),
    (("connector=flamingo", "--config.model.num_heads=128"),
     r"^config\.model\.num_heads=128: must divide the frozen encoder's model\.d_model, 64"),
    (("connector=qformer", "--config.model.qformer_width=30"),
     r"^config\.model\.num_heads=4: must divide model\.qformer_width=30"),
])
def test_connector_heads_that_do_not_divide_its_widths_are_a_config_error(arguments, message):
  """Validation passed them; building the connector then failed in MultiHeadAttention's ValueError, after the frozen
  encoder and LM had been trained or loaded. llava's projector has no heads; heads that divide the widths pass."""
  variant, *fields = arguments
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(helpers.load_config(f"--config=configs/vlm_digits.py:{variant}", *fields), mode="train")
  for variant, fields in (("llava", ["--config.model.num_heads=3"]), ("flamingo", ["--config.model.num_heads=8"]),
                          ("qformer", ["--config.model.num_heads=3", "--config.model.qformer_width=48"])):
    assert config_error_field(f"--config=configs/vlm_digits.py:connector={variant}", *fields) is None


@pytest.mark.parametrize("variant, argument, field", [
    ("connector=llava", "--config.model.cross_attention_every=3", "config.model.cross_attention_every"),
    ("connector=qformer", "--config.model.cross_attention_every=2", "config.model.cross_attention_every"),
    ("connector=qformer", "--config.model.resampler_blocks=2", "config.model.resampler_blocks"),
    ("connector=flamingo,latents=0", "--config.model.resampler_blocks=3", "config.model.resampler_blocks"),
    ("connector=flamingo", "--config.model.resampler_blocks=3", None),  # 32 latents: its resampler reads it
    ("connector=flamingo", "--config.model.cross_attention_every=2", None),
])
def test_flamingo_fields_set_for_a_connector_that_does_not_read_them_are_a_config_error(variant, argument, field):
  """Only flamingo builds gated blocks every k-th layer and a resampler (with latents): llava with
  cross_attention_every=3 or a resampler of 3 blocks without latents trained the model the defaults give, without a
  word (spatial_merge, llava's own, was refused for the others already)."""
  assert config_error_field(f"--config=configs/vlm_digits.py:{variant}", argument) == field


@pytest.mark.parametrize("variant, field", [
    ("connector=qformer,latents=0", "config.model.num_latents"), ("connector=llava,latents=8", "config.model.num_latents"),
    ("connector=llava,queries=4", "config.model.num_queries"), ("connector=flamingo,queries=8", "config.model.num_queries"),
    ("connector=flamingo,latents=0", None), ("connector=qformer,queries=4", None),
])
def test_latents_and_queries_set_for_a_connector_that_does_not_read_them_are_a_config_error(variant, field):
  """Only flamingo's resampler reads num_latents and only the Q-Former num_queries: llava with queries=4 trained the
  model the defaults give, without a word. The bundled configs' defaults (32 each) are the connectors' own_fields;
  configs/vlm_tsv.py (no pairs file named here) refuses the same before it asks for one."""
  assert config_error_field(f"--config=configs/vlm_digits.py:{variant}") == field
  assert config_error_field(f"--config=configs/vlm_tsv.py:{variant}") == (field or "config.data.train_file")


@pytest.mark.parametrize("variant, argument", [
    ("connector=llava", "--config.model.qformer_blocks=3"), ("connector=flamingo", "--config.model.qformer_width=32"),
    ("connector=llava", "--config.model.qformer_cross_attention_every=1")])
def test_qformer_fields_set_for_a_connector_that_does_not_read_them_are_a_config_error(variant, argument):
  """llava or flamingo with qformer_blocks=3 trained the model the defaults give, without a word."""
  field = argument.removeprefix("--").split("=")[0]
  assert config_error_field(f"--config=configs/vlm_digits.py:{variant}", argument) == field
  assert config_error_field("--config=configs/vlm_digits.py:connector=qformer", argument) is None


@pytest.mark.parametrize("mode", ["eval", "infer"])
def test_a_run_recorded_with_an_unread_connector_field_still_validates_for_eval_and_infer(mode):
  """Runs recorded when llava's and the Q-Former's num_latents defaulted to 0: eval and infer keep the run's model."""
  validation.validate_config(helpers.load_config("--config=configs/vlm_digits.py:connector=llava,latents=0"), mode=mode)


def test_description_distillation_needs_the_bundled_strips_descriptions():
  assert config_error_field("--config=configs/vlm_tsv.py", "--config.task.distill_weight=1.0") == \
      "config.task.distill_weight"
  assert config_error_field("--config=configs/vlm_digits.py:distill=0.5") is None


def test_microbatches_are_refused_with_distillation_whose_term_is_a_mean_of_its_own():
  assert config_error_field("--config=configs/vlm_digits.py:distill=0.5", "--config.num_microbatches=2") == \
      "config.num_microbatches"
  assert config_error_field("--config=configs/vlm_digits.py", "--config.num_microbatches=2") is None


def test_each_connector_trains_its_own_default_steps_and_learning_rate_unless_the_config_names_them():
  assert set(vlm_digits_config.DEFAULT_STEPS) == set(vlm_digits_config.DEFAULT_LR) == set(connectors.CONNECTORS)
  for connector, steps in vlm_digits_config.DEFAULT_STEPS.items():
    loaded = helpers.load_config(f"--config=configs/vlm_digits.py:connector={connector}")
    assert (loaded.total_steps, loaded.eval_every_steps, loaded.checkpoint.every_steps) == (steps,) * 3
    assert loaded.optimizer.learning_rate == vlm_digits_config.DEFAULT_LR[connector]
    pairs = helpers.load_config(f"--config=configs/vlm_tsv.py:connector={connector}")
    assert pairs.optimizer.learning_rate == vlm_digits_config.DEFAULT_LR[connector]
    assert loaded.task.distill_weight == pairs.task.distill_weight == 0.0
  named = helpers.load_config("--config=configs/vlm_digits.py:connector=llava,steps=50,lr=0.002")
  assert (named.total_steps, named.optimizer.learning_rate) == (50, 0.002)


@pytest.mark.parametrize("config", ["configs/vlm_digits.py:connector=flamingo", "configs/vlm_tsv.py"])
def test_the_connector_and_the_lm_split_over_the_cores_while_the_image_encoder_keeps_one_device(config):
  """The encoder ends first beside the LM; the LM then uses the core it leaves (configs/vlm_lm.py)."""
  loaded = helpers.load_config(f"--config={config}")
  lm = dependencies.load_config(loaded.model.lm_config, "model.lm_config")
  encoder = dependencies.load_config(loaded.model.encoder_config, "model.encoder_config")
  for cores in (2, 4):
    assert distributed.cpu_device_count(loaded, cores) == distributed.cpu_device_count(lm, cores) == cores
    assert distributed.cpu_device_count(encoder, cores) == 1


def test_llava_takes_mrope_positions_and_merged_patches():
  assert config_error_field("--config=configs/vlm_digits.py:connector=llava,positions=mrope,merge=2") is None


@pytest.mark.parametrize("config,missing", [("configs/vlm_digits.py:", None),
                                            ("configs/vlm_tsv.py:image_encoder=digits,", "config.data.train_file")])
def test_a_scale_argument_names_the_encoder_trained_at_that_scale(config, missing):  # (train_file: all tsv lacks)
  loaded = helpers.load_config(f"--config={config}scale=2")
  assert (loaded.data.scale, loaded.model.encoder_config, loaded.model.encoder_workdir) == (
      2, "configs/vlm_encoder.py:scale=2", "workdirs/vlm_encoder_x2")
  assert vlm_task.canvas(loaded) == (16, 64)
  assert config_error_field(f"--config={config}scale=2") == missing
  assert helpers.load_config(f"--config={config.rstrip(':,')}").model.encoder_workdir == "workdirs/vlm_encoder"


def test_the_probe_answers_what_its_reading_implies():
  examples = vlm_digits.make_examples("test", 80, seed=0)
  assert all(probe.answers_correct(examples, [e.digits for e in examples]))
  shifted = [tuple(tuple((d + 1) % 10 for d in s) for s in e.digits) for e in examples]  # every digit misread
  correct = dict.fromkeys(vlm_digits.KINDS, ())
  for example, ok in zip((e for e in examples for _ in e.targets()), probe.answers_correct(examples, shifted)):
    correct[example.kind] += (ok,)
  assert not any(correct["caption"] + correct["nth"]) and all(correct["count"])


def test_a_direct_sum_answers_the_sum_and_leaves_the_other_answers_to_the_digits_read():
  examples = [e for e in vlm_digits.make_examples("test", 80, seed=0) if e.kind in ("sum", "caption")]
  wrong_totals = [tuple(probe.Reading(s, total=sum(s) + 1) for s in e.digits) for e in examples]
  for example, ok in zip((e for e in examples for _ in e.targets()), probe.answers_correct(examples, wrong_totals)):
    assert ok == (example.kind == "caption")
  right_totals = [tuple(probe.Reading(((d + 1) % 10 for d in s), total=sum(s)) for s in e.digits)
                  for e in examples]  # every digit misread, every total right
  for example, ok in zip((e for e in examples for _ in e.targets()), probe.answers_correct(examples, right_totals)):
    assert ok == (example.kind == "sum")


def test_a_direct_sum_probe_predicts_a_total_per_image():
  # an untrained encoder of 2-digit strips (4 x 4 patches): the probe's plumbing, not its accuracy
  encoder = vit.ViT(num_classes=vlm_digits.NUM_POSITION_CLASSES, patch_size=4, grid=(2, 4), width=16, num_heads=2,
                    num_blocks=1, mlp_ratio=2, pool="gap", rngs=nnx.Rngs(params=0, dropout=0))
  trained, _ = probe.train_probe(encoder, max_digits=2, steps=2, batch_size=4, direct_sum=True)
  strips = [vlm_digits.draw_strip("test", np.random.default_rng(i), max_digits=2)[0] for i in range(3)]
  reads = probe.read_digits(encoder, strips, max_digits=2, probe=trained)
  assert len(reads) == 3 and all(0 <= r.total <= 18 for r in reads)
  assert all(r.total is None for r in probe.read_digits(encoder, strips, max_digits=2,
                                                        probe=probe.train_probe(encoder, max_digits=2, steps=2,
                                                                                batch_size=4)[0]))


def test_every_malformed_pairs_line_exits_2_naming_file_and_line_and_writes_nothing(tmp_path):
  Image.fromarray(np.full((8, 8), 200, np.uint8)).save(tmp_path / "ok.png")
  (tmp_path / "broken.png").write_bytes(b"not an image")
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("ok.png\tseven\n"          # 1: fine
                   "missing.png\tseven\n"     # 2: no such image
                   "broken.png\tseven\n"      # 3: unreadable image
                   "ok.png seven\n"           # 4: no tab
                   "ok.png\t \n")             # 5: empty text
  workdir = tmp_path / "run"
  result = helpers.launch("configs/vlm_tsv.py", workdir, overrides={
      "data.train_file": pairs, "data.eval_file": tmp_path / "ok_pairs.tsv"})
  assert result.returncode == 2, result.stderr[-2000:]
  for line in (2, 3, 4, 5):
    assert f"{pairs}:{line}: " in result.stderr, result.stderr[-2000:]
  assert f"{pairs}:1: " not in result.stderr
  assert not workdir.exists()


@pytest.mark.slow
def test_a_tiny_chain_trains_its_frozen_parts_then_the_connector_learns():
  chain = tiny_chain()
  for part in ("encoder", "lm"):
    assert (chain / part / "checkpoints").is_dir()
  losses = [row["train/loss"] for row in helpers.metric_rows(chain / "vlm") if "train/loss" in row]
  assert losses[-1] < 0.8 * losses[0], losses
  final = helpers.metric_rows(chain / "vlm")[-1]
  assert {"eval/exact_match", "eval/chrf", "eval/exact_match_count"} <= set(final)
  assert (chain / "vlm" / "frozen.json").is_file()


@pytest.mark.slow
def _with_a_worse_newer_checkpoint(run, metric: str, worse: float):
  """Adds to the run folder a checkpoint one step past its newest, of other weights (every float + 1) and a
  worse eval metric; returns (the original step, its weights, the shifted weights)."""
  step = checkpoints.step_numbers(str(run))[-1]
  step_directory = run / "checkpoints" / str(step)
  with ocp.StandardCheckpointer() as checkpointer:
    model, optimizer = (checkpointer.restore(step_directory / item) for item in ("model", "optimizer"))
  meta = json.loads((step_directory / "meta" / "metadata").read_text())
  shifted = jax.tree.map(lambda x: x + 1.0 if jax.dtypes.issubdtype(x.dtype, np.floating) else x, model)
  config = json.loads((run / "config.json").read_text())["checkpoint"]
  stored = checkpoints.Checkpoints(str(run), keep=5, best_metric=config["best_metric"], best_mode=config["best_mode"])
  stored.save(step + 1, shifted, optimizer, {**meta, "step": step + 1}, {metric: worse})
  stored.close()
  return step, model, shifted


def test_each_frozen_part_is_read_at_the_checkpoint_its_run_names_as_its_result(tmp_path):
  """Each frozen run gets a newer checkpoint of other weights and a worse eval metric: a VLM reads that newest
  one while the run's config reads its latest, and the encoder's best (the original) once its
  checkpoint.eval_from is 'best', as that run's --mode=eval would; frozen.json names the steps. (The LM keeps no
  best checkpoint: configs/vlm_lm.py.)"""
  chain = tiny_chain()
  parts = {"encoder": tmp_path / "encoder", "lm": tmp_path / "lm"}
  for part, run in parts.items():
    shutil.copytree(chain / part, run)
  encoder_step, encoder_original, encoder_shifted = _with_a_worse_newer_checkpoint(
      parts["encoder"], "eval/position_accuracy", -1.0)
  lm_step, _, lm_shifted = _with_a_worse_newer_checkpoint(parts["lm"], "eval/loss", 1e9)

  def frozen_parts(eval_from):
    run = json.loads((parts["encoder"] / "config.json").read_text())
    run["checkpoint"]["eval_from"] = eval_from
    (parts["encoder"] / "config.json").write_text(json.dumps(run))
    overrides = {**TINY_CHAIN, "model.encoder_workdir": parts["encoder"], "model.lm_workdir": parts["lm"]}
    config = helpers.load_config("--config=configs/vlm_digits.py:connector=llava,kinds=count",
                                 *(f"--config.{field}={value}" for field, value in overrides.items()))
    workdir = tmp_path / f"vlm_{eval_from}"
    task = vlm_task.VLMTask(config, str(workdir), "train")
    return task.weights, json.loads((workdir / vlm_frozen.FROZEN_RECORD).read_text())

  for eval_from, step, weights in (("latest", encoder_step + 1, encoder_shifted), ("best", encoder_step,
                                                                                   encoder_original)):
    read, record = frozen_parts(eval_from)
    assert (record["encoder_step"], record["lm_step"]) == (step, lm_step + 1)
    for part, expected in (("encoder", weights), ("lm", lm_shifted)):
      flat = dict(jax.tree_util.tree_leaves_with_path(expected))
      for path, value in jax.tree_util.tree_leaves_with_path(read[part]):
        np.testing.assert_array_equal(value, flat[path], err_msg=f"{eval_from}, {part}: {jax.tree_util.keystr(path)}")


def _shape_pairs(folder, name: str, count: int) -> pathlib.Path:
  """A pairs file of `count` drawings (a filled square, a bar, a cross) with captions in words that no digits
  text holds."""
  drawings = {"square": np.pad(np.full((6, 6), 255, np.uint8), 1), "bar": np.pad(np.full((2, 14), 255, np.uint8), 3),
              "cross": np.maximum(np.eye(8, dtype=np.uint8), np.eye(8, dtype=np.uint8)[::-1]) * 255}
  for shape, pixels in drawings.items():
    Image.fromarray(pixels).save(folder / f"{shape}.png")
  shapes = list(drawings) * count
  path = folder / name
  path.write_text("".join(f"{shape}.png\ta black {shape}\n" for shape in shapes[:count]))
  return path


# Sized by its captions as the default is (configs/vlm_lm.py: epochs passes, at least min_steps, at most steps):
# the 48 pairs' text packs into fewer rows than a batch, one step an epoch, so 40 epochs end it at step 40.
PAIRS_LM_CONFIG = "configs/vlm_lm.py:text=pairs,steps=400,size=micro,epochs=40,min_steps=10"


def shape_pairs() -> pathlib.Path:
  """A folder with train.tsv (48 pairs) and eval.tsv (6) of shape drawings; built once per session."""
  def build(directory):
    _shape_pairs(directory, "train.tsv", 48)
    _shape_pairs(directory, "eval.tsv", 6)
  return helpers.build_once("vlm_shape_pairs", build)


# The pairs chain's own encoder, sized by its 48 images as the default is: fewer than a batch, one step a pass,
# 80 passes of 200 steps
PAIRS_ENCODER_CONFIG = ("configs/vlm_encoder.py:data=pairs,canvas=16x16,steps=200,epochs=80,min_steps=10,width=32,"
                        "blocks=1,warmup=10")


def pairs_chain() -> pathlib.Path:
  """A folder with encoder/, lm/ and vlm/: one launch of configs/vlm_tsv.py (a qformer, 60 steps, the 16 x 16
  canvas) on shape_pairs() whose encoder and LM workdirs held no run, so the launcher trained an image encoder
  on the pairs' images and the LM on their text first. Built once per session; tests must not write into it."""
  pairs = shape_pairs()
  def build(directory):
    overrides = {**TINY_CHAIN, "model.encoder_workdir": directory / "encoder", "model.lm_workdir": directory / "lm",
                 "model.encoder_config": PAIRS_ENCODER_CONFIG, "model.lm_config": PAIRS_LM_CONFIG,
                 "data.train_file": pairs / "train.tsv", "data.eval_file": pairs / "eval.tsv"}
    result = helpers.launch("configs/vlm_tsv.py:connector=qformer,steps=60,queries=4,canvas=16x16",
                            directory / "vlm", "--dependencies=in_turn", overrides=overrides)  # (as tiny_chain's)
    if result.returncode:
      raise RuntimeError(f"the pairs chain failed (exit {result.returncode}): {result.stderr[-3000:]}")
  return helpers.build_once("vlm_pairs_chain", build)


@pytest.mark.slow
def test_a_users_pairs_train_their_own_lm_first_so_their_words_can_be_written(tmp_path):
  """configs/vlm_tsv.py read a user's pairs with the digits' LM, whose pieces cannot spell "black" or "cross":
  exact match was 0 whatever the connector learned."""
  pairs, chain, run = shape_pairs(), tiny_chain(), pairs_chain()
  train, evaluation = pairs / "train.tsv", pairs / "eval.tsv"
  lm_config = json.loads((run / "lm" / "config.json").read_text())  # trained first, on the pairs' text
  assert (lm_config["data"]["train_file"], lm_config["data"]["eval_file"]) == (str(train), str(evaluation))
  # its length followed the captions (40 passes of one step), and the VLM launch took it as finished there; the
  # workdir keeps the budget as written
  assert (lm_config["total_steps"], lm_config["max_epochs"], lm_config["min_steps"]) == (400, 40.0, 10)
  assert json.loads((run / "lm" / task_lib.END_STEP_FILE).read_text())["end_step"] == 40
  assert checkpoints.step_numbers(str(run / "lm"))[-1] == 40
  tokenizer = tokenizers.SentencePieceTokenizer(run / "vlm" / vlm_frozen.TOKENIZER_FILE)
  assert tokenizer.decode(tokenizer.encode("a black cross")) == "a black cross"
  rows = helpers.metric_rows(run / "vlm")
  losses = [row["train/loss"] for row in rows if "train/loss" in row]
  assert losses[-1] < 0.6 * losses[0], losses
  # without reading the image one caption fits all, 2 of the 6 eval pairs: the connector reads the shape
  assert rows[-1]["eval/exact_match"] > 0.6, rows[-1]
  # another pairs file with the same LM workdir: named before anything trains
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": run / "lm",
               "model.lm_config": PAIRS_LM_CONFIG, "data.train_file": train, "data.eval_file": evaluation}
  config = helpers.load_config("--config=configs/vlm_tsv.py:connector=qformer,image_encoder=digits", *(
      f"--config.{field}={value}" for field, value in {**overrides, "data.train_file": evaluation}.items()))
  with pytest.raises(validation.ConfigError, match="data.train_file") as error:
    dependencies.resolve(config, str(tmp_path / "vlm2"), "train")
  assert error.value.field == "model.lm_workdir" and not (tmp_path / "vlm2").exists()
  # another eval file only: the same LM (it never trains on the eval captions), loaded as it is
  config = helpers.load_config("--config=configs/vlm_tsv.py:connector=qformer,image_encoder=digits", *(
      f"--config.{field}={value}" for field, value in {**overrides, "data.eval_file": train}.items()))
  lm_steps = checkpoints.step_numbers(str(run / "lm"))
  dependencies.resolve(config, str(tmp_path / "vlm3"), "train")
  assert checkpoints.step_numbers(str(run / "lm")) == lm_steps


@pytest.mark.slow
def test_a_users_pairs_train_an_image_encoder_of_their_own_first(tmp_path):
  """configs/vlm_tsv.py read every user's pictures with the digits' strip reader, fitted into its grey 8 x 32
  canvas: now its default encoder is trained first on the pairs' own images (configs/vlm_encoder.py:data=pairs),
  at the VLM's canvas, to name each caption's words; then the connector (pairs_chain(): the same launch trained
  the LM on their text). Grey, the default (RGB: the encoder's training in test_trainer's microbatch test, its
  reading colour in test_vlm_encoder, the setting reaching both in
  test_colour_is_one_setting_of_the_vlm_and_its_encoder)."""
  pairs, run = shape_pairs(), pairs_chain()
  train, evaluation = pairs / "train.tsv", pairs / "eval.tsv"
  encoder_run = json.loads((run / "encoder" / "config.json").read_text())
  assert encoder_run["task"]["name"] == "vlm_pairs_encoder" and encoder_run["data"]["canvas"] == "16x16"
  assert encoder_run["model"]["channels"] == 1
  assert (encoder_run["data"]["train_file"], encoder_run["data"]["eval_file"]) == (str(train), str(evaluation))
  assert checkpoints.step_numbers(str(run / "encoder"))[-1] == 80 and encoder_run["total_steps"] == 200
  # every caption is "a black <shape>": naming its shared terms alone ("a", "black", "a black") is F1 0.75
  encoder_eval = [row for row in helpers.metric_rows(run / "encoder") if "eval/word_f1" in row][-1]
  assert encoder_eval["eval/word_f1"] > 0.9, encoder_eval
  frozen = json.loads((run / "vlm" / vlm_frozen.FROZEN_RECORD).read_text())
  # the one it trained (the chain was built in a folder since renamed: compare within it)
  built = pathlib.Path(frozen["encoder_workdir"])
  assert built.name == "encoder" and pathlib.Path(frozen["lm_workdir"]) == built.parent / "lm", frozen
  # the encoder names the words of a picture it reads
  inferred = helpers.launch(f"{run / 'encoder'}/config.py", run / "encoder", "--mode=infer",
                            stdin=f"{pairs / 'cross.png'}\n")
  assert inferred.returncode == 0, inferred.stderr[-2000:]
  assert "cross" in inferred.stdout.strip().split("\t")[-1].split(" | "), inferred.stdout
  # another pairs file with the same encoder workdir: named before anything trains
  overrides = {**TINY_CHAIN, "model.encoder_workdir": run / "encoder", "model.lm_workdir": run / "lm",
               "model.encoder_config": PAIRS_ENCODER_CONFIG, "model.lm_config": PAIRS_LM_CONFIG,
               "data.train_file": evaluation, "data.eval_file": evaluation}
  config = helpers.load_config("--config=configs/vlm_tsv.py:connector=qformer,canvas=16x16",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  with pytest.raises(validation.ConfigError, match="data.train_file") as error:
    dependencies.resolve(config, str(tmp_path / "vlm2"), "train")
  assert error.value.field == "model.encoder_workdir" and not (tmp_path / "vlm2").exists()


def test_colour_is_one_setting_of_the_vlm_and_its_encoder(tmp_path):
  """color=true asks both for RGB; a grey encoder under an RGB VLM is named before anything trains."""
  from configs import vlm_tsv as vlm_tsv_config
  loaded = helpers.load_config("--config=configs/vlm_tsv.py:color=true")
  assert loaded.data.color and loaded.model.encoder_config.endswith(",color=true")
  grey_encoder = {"model.encoder_config": "configs/vlm_encoder.py:data=pairs,canvas=32x32"}
  assert config_error_field("--config=configs/vlm_tsv.py:color=true",
                            *(f"--config.{k}={v}" for k, v in grey_encoder.items())) == "config.data.color"
  with pytest.raises(ValueError, match="color=true"):
    vlm_tsv_config.get_config("image_encoder=digits,color=true")


@pytest.mark.parametrize("arg,reader", [("image_encoder=digits,canvas=16x16", "image_encoder=pairs"),
                                        ("scale=2", "image_encoder=digits"), ("kinds=count", "bundled strips")])
def test_a_config_argument_the_chosen_image_encoder_does_not_read_is_refused_not_ignored(arg, reader):
  from configs import vlm_tsv as vlm_tsv_config
  with pytest.raises(ValueError, match=f"config argument {arg.split(',')[-1]}: read by .*{reader}"):
    vlm_tsv_config.get_config(arg)
  assert vlm_tsv_config.get_config("image_encoder=digits,scale=2,color=false").data.scale == 2  # its own, defaults


def _pairs_task(folder, train_text: str, eval_text: str, **overrides) -> vlm_task.VLMTask:
  """The VLM task of a user's pairs (configs/vlm_tsv.py, llava) on the tiny chain's frozen parts: train_text and
  eval_text are the pairs files' contents, each line's image ok.png, a flat grey 8 x 8."""
  chain = tiny_chain()
  Image.fromarray(np.full((8, 8), 200, np.uint8)).save(folder / "ok.png")
  (folder / "train.tsv").write_text(train_text)
  (folder / "eval.tsv").write_text(eval_text)
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.train_file": folder / "train.tsv", "data.eval_file": folder / "eval.tsv", **overrides}
  config = helpers.load_config("--config=configs/vlm_tsv.py:connector=llava,image_encoder=digits",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  return vlm_task.VLMTask(config, None, "train")


def test_a_text_past_the_frozen_lms_learned_position_table_is_named_by_file_and_line(tmp_path, monkeypatch):
  """A caption longer than a learned-position LM's table read NaN positions: the run ended in "TrainingDiverged:
  train/loss = nan at step 2", naming neither the caption nor the table; a generation past its end wrote garbage."""
  as_built = vlm_frozen.lm_model_config
  def learned(lm_model, image_positions):
    lm_model = as_built(lm_model, image_positions)
    lm_model.position_encoding, lm_model.max_length = "learned", 40
    return lm_model
  monkeypatch.setattr(vlm_frozen, "lm_model_config", learned)
  long = " ".join(["seven"] * 60)
  Image.fromarray(np.full((8, 8), 60, np.uint8)).save(tmp_path / "dark.png")
  with pytest.raises(validation.ConfigError, match=r"eval\.tsv:3: the text and its image tokens take \d+ positions; "
                                                   r"the frozen LM's learned position table holds 40 \(model.max_length"):
    _pairs_task(tmp_path, "ok.png\tseven\n" * 3, f"ok.png\tseven\nok.png\ttwo\nok.png\t{long}\n")
  # without an eval file, its line in the training file, on whichever side of the split its image fell
  with pytest.raises(validation.ConfigError, match=r"train\.tsv:2: the text and its image tokens take"):
    _pairs_task(tmp_path, f"ok.png\tseven\ndark.png\t{long}\n" + "ok.png\tseven\ndark.png\ttwo\n" * 2, "",
                **{"data.eval_file": ""})
  task = _pairs_task(tmp_path, "ok.png\tseven\n" * 3, "ok.png\ttwo\n")
  assert task.length <= 40
  # generation stops where the table ends (past it the LM wrote garbage from NaN positions), and a prompt that
  # fills the table is refused
  assert (task._new_tokens_that_fit(24, 10), task._new_tokens_that_fit(24, 32)) == (10, 16)
  with pytest.raises(RunError, match="leave no room"):
    task._new_tokens_that_fit(40, 8)


def test_without_an_eval_file_the_encoder_the_lm_and_the_vlm_hold_out_the_same_pairs(tmp_path):
  """configs/vlm_tsv.py required an eval file. Without one each of the three runs that read the pairs holds out
  image_text.held_out_pairs of the training file, so none trains on a held-out image or its captions."""
  from xattn_jax.data import image_text
  from xattn_jax.tasks.lm import text as lm_task
  from xattn_jax.tasks.vlm import encoder as encoder_lib
  words = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
  lines = []
  for n in range(60):  # 60 images, two captions each
    Image.fromarray(np.full((8, 8), 3 * n, np.uint8)).save(tmp_path / f"img{n}.png")
    lines += [f"img{n}.png\t{words[n % 9]}\n", f"img{n}.png\t{words[n % 9]} {words[(n // 9) % 9]}\n"]
  train_text = "".join(lines)
  held = image_text.held_out_pairs(_write(tmp_path / "train.tsv", train_text))
  held_captions = [lines[i].rstrip("\n").split("\t")[1] for i in sorted(held)]
  assert held and all((2 * (i // 2) in held) and (2 * (i // 2) + 1 in held) for i in held)

  vlm = _pairs_task(tmp_path, train_text, "", **{"data.eval_file": ""})
  assert [e.targets()[0] for e in vlm.eval_examples] == held_captions
  assert len(vlm.train_examples) == 120 - len(held)

  encoder = helpers.load_config("--config=configs/vlm_encoder.py:data=pairs,canvas=16x16",
                                f"--config.data.train_file={tmp_path / 'train.tsv'}")
  assert [e.targets()[0] for e in encoder_lib.read_pairs_field(encoder, "data.eval_file")] == held_captions
  assert len(encoder_lib.read_pairs_field(encoder, "data.train_file")) == 120 - len(held)

  lm = helpers.load_config("--config=configs/vlm_lm.py:text=pairs,size=micro",
                           f"--config.data.train_file={tmp_path / 'train.tsv'}")
  task = lm_task.LanguageModelTask(lm, str(tmp_path / "lm"), "train")
  assert list(task.eval_texts) == [f"{vlm_digits.IMAGE_TOKEN} {caption}" for caption in held_captions]

  pairs = helpers.load_config("--config=configs/vlm_tsv.py", f"--config.data.train_file={tmp_path / 'train.tsv'}")
  assert vlm_frozen.lm_config(pairs).data.eval_file == vlm_frozen.encoder_config(pairs).data.eval_file == ""


def _write(path, text: str):
  path.write_text(text)
  return path


def test_eval_generates_up_to_the_longest_reference_so_none_is_cut_short(tmp_path):
  """Eval generated at most task.decoding.max_new_tokens (8): a user's 12-word caption could never match."""
  long_caption = " ".join(["seven", "two"] * 6)
  task = _pairs_task(tmp_path, "ok.png\tseven\n", f"ok.png\tseven\nok.png\t{long_caption}\n",
                     **{"task.decoding.max_new_tokens": 8})
  limits = []
  task.generate = lambda model, requests, max_new_tokens=None: limits.append(max_new_tokens) or [""] * len(requests)
  task.extra_eval(None)
  assert limits == [len(task.tokenizer.encode(long_caption)) + 1] and limits[0] > 8


def test_new_tokens_past_the_frozen_lms_context_are_refused_before_anything_compiles(tmp_path):
  """max_new_tokens=100000 generated 100,000 tokens past the frozen LM's 256 positions, for minutes, where the LM's
  own task refuses more than its context holds."""
  with pytest.raises(validation.ConfigError, match="<= 254: the frozen LM's context") as error:
    _pairs_task(tmp_path, "ok.png\tseven\n", "ok.png\tseven\n", **{"task.decoding.max_new_tokens": 100000})
  assert error.value.field == "task.decoding.max_new_tokens"
  assert _pairs_task(tmp_path, "ok.png\tseven\n", "ok.png\tseven\n",
                     **{"task.decoding.max_new_tokens": 254}).max_new_tokens == 254


def test_eval_chrf_is_on_the_translators_0_to_100_scale(tmp_path):
  """The VLM logged chrF on [0, 1] and the translator on sacrebleu's 0-100: one scale for eval/chrf."""
  import sacrebleu
  task = _pairs_task(tmp_path, "ok.png\tseven\n", "ok.png\tseven two\nok.png\tnine\n")
  task.generate = lambda model, requests, max_new_tokens=None: ["seven two", "nine"]
  assert task.extra_eval(None)["chrf"] == pytest.approx(100.0)
  task.generate = lambda model, requests, max_new_tokens=None: ["seven", "nine"]
  metrics = task.extra_eval(None)
  expected = sacrebleu.corpus_chrf(["seven", "nine"], [["seven two", "nine"]]).score
  assert metrics["chrf"] == pytest.approx(expected) and 1.0 < metrics["chrf"] < 100.0
  assert metrics["exact_match"] == 0.5


def test_an_eval_file_showing_training_images_is_said_not_held_out(tmp_path, caplog):
  """An eval file drawn from the training pairs (189 of its 200 images trained on) was scored without a word."""
  import logging
  caplog.set_level(logging.WARNING)
  _pairs_task(tmp_path, "".join(f"ok.png\t{vlm_digits.number_words(n)}\n" for n in range(20)), "./ok.png\tseven\n")
  assert any(f"1 of the 1 eval images in {tmp_path / 'eval.tsv'} are also training images in "
             f"{tmp_path / 'train.tsv'}: eval metrics are not held-out scores" in r.getMessage() for r in caplog.records)


def test_a_users_pairs_come_shuffled_every_epoch_each_once(tmp_path):
  """The pairs were cycled in file order, so a file sorted by subject made one-subject batches."""
  task = _pairs_task(tmp_path, "".join(f"ok.png\t{vlm_digits.number_words(n)}\n" for n in range(40)),
                     "ok.png\tseven\n")
  task._rows = lambda examples, layouts, indices, **_: np.asarray(indices)  # the pair (file line - 1) of each row
  def epoch(e):  # 40 pairs at batch 16: 2 steps an epoch, 8 pairs left out (a different 8 each epoch)
    return np.concatenate([task.train_batch(step, process_index=0, process_count=1) for step in (2 * e, 2 * e + 1)])
  first, second = epoch(0), epoch(1)
  assert len(set(first)) == len(first) == 32 and len(set(second)) == 32
  assert not np.array_equal(first, np.arange(32)) and not np.array_equal(first, second)
  halves = [task.train_batch(3, process_index=p, process_count=2) for p in (0, 1)]
  np.testing.assert_array_equal(np.concatenate(halves), task.train_batch(3, process_index=0, process_count=1))


def test_length_bucketing_pads_each_batch_to_its_own_examples_and_leaves_the_loss_unchanged():
  """Rows padded to the longest example and two image slots each: in the bundled batches half the LM's token
  slots and a third of the image slots were padding."""
  import jax.numpy as jnp
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.length_bucketing": True}
  config = helpers.load_config("--config=configs/vlm_digits.py:connector=qformer,queries=4",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  task = vlm_task.VLMTask(config, None, "train")
  steps = len(task.train_examples) // config.batch_size
  seen, shapes = [], set()
  for step in range(steps):  # one epoch
    rows = task._train_order.batch(step, config.data.seed, config.batch_size)
    batch = task.train_batch(step, process_index=0, process_count=1)
    images = max(len(task.train_examples[i].images) for i in rows)
    length = max(len(task.train_layouts[i].ids) for i in rows)
    assert batch["features"].shape[1] == batch["pixel_valid"].shape[1] == images
    assert length <= batch["tokens"].shape[1] == -(-length // 8) * 8
    seen += rows.tolist()
    shapes.add(batch["tokens"].shape + batch["pixel_valid"].shape[1:2])
  assert len(set(seen)) == len(seen) == steps * config.batch_size
  assert min(shape[1] for shape in shapes) < task.length and min(shape[2] for shape in shapes) == 1
  # A bucketed batch's loss is the loss of the same rows padded to the longest example and two image slots.
  model = task.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
  short = next(step for step in range(steps) if task.train_batch(step, process_index=0, process_count=1)
               ["pixel_valid"].shape[1] == 1)
  rows = task._train_order.batch(short, config.data.seed, config.batch_size)
  bucketed = task.train_batch(short, process_index=0, process_count=1)
  padded = task._rows(task.train_examples, task.train_layouts, rows)  # pixels: the encoder runs in the step
  assert padded["tokens"].shape[1] > bucketed["tokens"].shape[1] and padded["images"].shape[1] == 2
  loss = nnx.jit(lambda model, batch: task.loss(model, batch, rngs=None)[0])
  losses = [float(loss(model, {k: jnp.asarray(v) for k, v in b.items()})) for b in (bucketed, padded)]
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


@pytest.mark.parametrize("connector", ["flamingo", "qformer,queries=4", "llava,positions=mrope"])
def test_cached_frozen_features_give_the_loss_and_gradients_of_the_pixels(connector):
  """data.cache_features: the encoder reads every training image once; a step's batch then carries the
  features, not pixels, and trains the connector exactly as the pixels do."""
  import jax
  import jax.numpy as jnp
  chain = tiny_chain()
  # unbucketed: the cycled rows mix one- and two-image examples, so a batch has empty slots
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.length_bucketing": False}
  config = helpers.load_config(f"--config=configs/vlm_digits.py:connector={connector}",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  assert config.data.cache_features  # the default
  task = vlm_task.VLMTask(config, None, "train")
  cached = task.train_batch(3, process_index=0, process_count=1)
  assert "images" not in cached and cached["features"].shape[:2] == cached["pixel_valid"].shape[:2]
  rows = (3 * config.batch_size + np.arange(config.batch_size)) % len(task.train_examples)
  pixels = task._rows(task.train_examples, task.train_layouts, rows)
  assert "features" not in pixels and (pixels["image_valid"].sum(1) == 2).any()  # an empty slot and a second image
  model = task.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  def loss(params, batch):
    return task.loss(nnx.merge(graph, params, rest), {k: jnp.asarray(v) for k, v in batch.items()}, rngs=None)[0]
  value_and_grad = jax.jit(jax.value_and_grad(loss))
  (loss_cached, grads_cached), (loss_pixels, grads_pixels) = (value_and_grad(params, b) for b in (cached, pixels))
  np.testing.assert_allclose(float(loss_cached), float(loss_pixels), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_cached), jax.tree.leaves(grads_pixels)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="features"):  # features of another encoder width
    model(None, cached["pixel_valid"], cached["image_valid"], cached["tokens"], cached["valid"],
          features=cached["features"][..., :-1])


def test_training_features_are_read_by_the_encoder_only_while_they_fit_in_memory(monkeypatch):
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm"}
  config = helpers.load_config("--config=configs/vlm_digits.py:connector=llava",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  monkeypatch.setattr(vlm_task, "FEATURE_CACHE_MAX_BYTES", 1000)
  batch = vlm_task.VLMTask(config, None, "train").train_batch(0, process_index=0, process_count=1)
  assert "images" in batch and "features" not in batch


@pytest.mark.parametrize("connector", ["flamingo", "qformer,queries=4", "llava"])
def test_distillation_pairs_each_token_after_an_image_with_its_place_in_the_described_text(connector):
  """task.distill_weight: a training row also carries its text with each image described in words, and where
  each of its tokens sits there: the marker of every image and all text after the first; soft tokens and the
  text before the first image are not compared."""
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.cache_features": False}
  config = helpers.load_config(f"--config=configs/vlm_digits.py:connector={connector},distill=1.0",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  task = vlm_task.VLMTask(config, None, "train")
  for example, layout in zip(task.train_examples, task.train_layouts):
    described = task.tokenizer.decode(layout.teacher_ids[1:-1].tolist())
    assert described.split() == vlm_digits.described_text_of(example).split()
    compared = layout.teacher_index >= 0
    np.testing.assert_array_equal(layout.teacher_ids[layout.teacher_index[compared]], layout.ids[compared])
    first_marker = int(np.argmax(layout.ids == task.marker))
    assert not compared[:first_marker].any()
    np.testing.assert_array_equal(compared[first_marker:], layout.ids[first_marker:] != vlm.SOFT_TOKEN)
  assert {len(example.images) for example in task.train_examples} == {1, 2}
  # the frozen LM's states on the described texts, computed once: those of its own pass over each text
  import jax.numpy as jnp
  model = task.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
  batch = task.train_batch(0, process_index=0, process_count=1)
  rows = task._train_order.batch(0, config.data.seed, config.batch_size)  # bucketed, the default
  lm = task.lm_model
  assert batch["distill_target"].shape == batch["tokens"].shape + (lm.num_layers, lm.d_model)
  hidden_states = nnx.jit(vlm.lm_hidden_states)
  for row, index in enumerate(rows[:4]):
    layout = task.train_layouts[index]
    states = np.stack(hidden_states(model.lm, jnp.asarray(layout.teacher_ids[None])), axis=2)[0]
    compared = np.flatnonzero(layout.teacher_index >= 0)
    np.testing.assert_array_equal(np.flatnonzero(batch["distill_mask"][row]), compared)
    np.testing.assert_allclose(batch["distill_target"][row, compared], states[layout.teacher_index[compared]],
                               rtol=1e-4, atol=1e-5)
  eval_batch = next(task.eval_batches(process_index=0, process_count=1))
  assert "distill_target" not in eval_batch


def test_distillation_is_learned_and_trains_only_the_connector():
  """Steps on the distillation term alone bring the LM's states reading a batch's images toward its states
  reading their descriptions; its gradients reach the connector only."""
  import jax
  import jax.numpy as jnp
  import optax
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm"}
  config = helpers.load_config("--config=configs/vlm_digits.py:connector=qformer,queries=4,distill=1.0",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  task = vlm_task.VLMTask(config, None, "train")
  batch = {k: jnp.asarray(v) for k, v in task.train_batch(0, process_index=0, process_count=1).items()}
  model = task.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
  frozen = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, vlm.latent_reader.FrozenParam)))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    def distill(model):
      return task.loss(model, batch, rngs=None)[1]["distill"]
    value, grads = nnx.value_and_grad(distill)(model)
    optimizer.update(model, grads)
    return value
  losses = [float(step(model, optimizer)) for _ in range(40)]
  assert losses[-1] < 0.6 * losses[0], losses
  after = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, vlm.latent_reader.FrozenParam)))
  jax.tree.map(np.testing.assert_array_equal, frozen, after)


def test_distillation_refuses_more_blocks_than_the_lm_has_and_states_that_do_not_fit(monkeypatch):
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.cache_features": False}
  config = helpers.load_config("--config=configs/vlm_digits.py:connector=qformer,distill=1.0,distill_blocks=9",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  with pytest.raises(validation.ConfigError, match="task.distill_blocks"):
    vlm_task.VLMTask(config, None, "train")
  config.task.distill_blocks = 0
  monkeypatch.setattr(distillation, "DESCRIBED_STATES_MAX_BYTES", 1000)
  with pytest.raises(validation.ConfigError, match="task.distill_weight.*GiB"):
    vlm_task.VLMTask(config, None, "train")


def test_describe_first_is_for_the_bundled_strips_whose_lm_learned_described_texts():
  assert config_error_field("--config=configs/vlm_tsv.py", "--config.task.describe_first=true") == \
      "config.task.describe_first"
  assert config_error_field("--config=configs/vlm_digits.py", "--config.task.describe_first=true") is None
  assert not helpers.load_config("--config=configs/vlm_digits.py").task.describe_first  # the default answers


def _random_lm_weights(model):
  """The VLM's LM with weights drawn at random: the tiny chain's 30-step LM writes "? ? ?" whatever it reads, so
  a test of what generation reads needs one whose continuation depends on all of it."""
  import jax.numpy as jnp
  leaves, tree = jax.tree.flatten(nnx.state(model.lm))
  draws = jax.random.split(jax.random.key(1), len(leaves))
  nnx.update(model.lm, jax.tree.unflatten(tree, [jax.random.normal(key, x.shape, x.dtype) if
                                                 jnp.issubdtype(x.dtype, jnp.floating) else x
                                                 for key, x in zip(draws, leaves)]))


@pytest.mark.parametrize("connector", ["flamingo", "llava"])
def test_describe_first_answers_from_the_models_own_descriptions_through_the_frozen_lm_alone(connector, tmp_path):
  """task.describe_first: each image is described alone, as the model captions it; every other target is the
  frozen LM's own greedy continuation of the text with those descriptions before the markers. Flamingo's
  gates are open, so a second pass through its inserted layers would answer otherwise. Infer alike."""
  import jax.numpy as jnp
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.num_eval_examples": 8, "task.describe_first": True}
  config = helpers.load_config(f"--config=configs/vlm_digits.py:connector={connector}",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  task = vlm_task.VLMTask(config, None, "train")
  model = task.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
  for block in getattr(model.connector, "blocks", ()):  # flamingo: the image reaches the text
    for residual in (block.attention_residual, block.mlp_residual):
      residual.gate[...] = jnp.ones_like(residual.gate[...])
  _random_lm_weights(model)
  bos, marker, suppressed = task.tokenizer.bos_id, task.marker, list(task.tokenizer.never_generated_ids)

  def caption(image):  # the model's own generation after the image alone
    prompt = [bos] + [vlm.SOFT_TOKEN] * task.slots(image) + [marker]
    return task.generate(model, [((image,), prompt, tokenizers.EOS_ID)], task.eval_new_tokens)[0]

  forward = nnx.jit(lambda lm, ids: lm(ids))
  width = 64  # the prefix padded on the right: a causal LM's logits at a position never read what follows it

  def frozen_lm(prompt, stop):  # greedy by the frozen LM's full forward on the growing prefix
    ids = list(prompt)
    for _ in range(task.eval_new_tokens):
      assert len(ids) <= width, len(ids)
      logits = np.array(forward(model.lm, jnp.asarray([ids + [0] * (width - len(ids))]))[0, len(ids) - 1])
      logits[suppressed] = -np.inf
      ids.append(int(np.argmax(logits)))
      if ids[-1] == tokenizers.EOS_ID:
        break
    return task._cut(ids[len(prompt):], stop)

  answers, asked = iter(task.eval_answers(model)), 0
  for example, layout in zip(task.eval_examples, task.eval_layouts):
    words = [caption(image) for image in example.images]
    ids, previous, targets = [bos], None, iter(layout.targets)
    for role, value in example.segments:
      if role == "image":
        ids += task.tokenizer.encode(words[value]) + [marker]
      elif role == "text":
        ids += task.tokenizer.encode(value)
      else:
        _, stop, reference = next(targets)
        kind, _, scored, answer = next(answers)
        after_image = previous is not None and previous[0] == "image"
        assert (kind, scored) == (example.kind, " ".join(reference.split()))
        assert answer == (words[previous[1]] if after_image else frozen_lm(ids, stop)), (example.segments, answer)
        asked += not after_image
        ids += task.tokenizer.encode(value)
      previous = (role, value)
  assert next(answers, None) is None and asked and {len(e.images) for e in task.eval_examples} == {1, 2}
  path = tmp_path / "strip.png"
  Image.fromarray((255 * (1 - task.eval_examples[0].images[0])).astype(np.uint8)).save(path)
  described, question = task.infer(model, [str(path), f"{path}\twhat is their sum ?"])
  loaded = vlm_task.image_text.load_image(str(path), task.canvas, grey=True)
  assert described == (caption(loaded) or "(nothing)")
  assert question == (frozen_lm([bos] + task.tokenizer.encode(caption(loaded)) + [marker]
                                + task.tokenizer.encode("what is their sum ?"), tokenizers.EOS_ID) or "(nothing)")


@pytest.mark.parametrize("describe_first", [False, True])
def test_a_sampled_answer_depends_on_its_own_line_not_on_the_lines_before_it(describe_first, tmp_path):
  """A line's sampling key was its request's place in each round of generation: the same question read
  differently after a blank line than after a two-image caption line (two requests). Keyed by its line number
  and its place in the line, it reads the same; at another line number, another draw."""
  import jax.numpy as jnp
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.num_eval_examples": 8, "task.describe_first": describe_first, "task.decoding.max_new_tokens": 6,
               "task.decoding.method": "sample", "task.decoding.temperature": 3.0}
  config = helpers.load_config("--config=configs/vlm_digits.py:connector=llava",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  task = vlm_task.VLMTask(config, None, "train")
  model = task.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
  _random_lm_weights(model)
  example = next(e for e in task.eval_examples if len(e.images) == 2)
  paths = [tmp_path / f"{i}.png" for i in range(2)]
  for path, image in zip(paths, example.images):
    Image.fromarray((255 * (1 - image)).astype(np.uint8)).save(path)
  question = f"{paths[0]}\twhat is their sum ?"
  after_blank = task.infer(model, ["", question])
  after_two = task.infer(model, [f"{paths[0]}\t{paths[1]}\t", question])
  assert after_blank[1] == after_two[1] and after_blank[1], (after_blank, after_two)
  assert task.infer(model, [question])[0] != after_blank[1]  # line 1: another key


@pytest.mark.parametrize("connector,describe_first", [("flamingo", False), ("llava", False), ("llava", True)])
def test_infer_reads_two_images_each_captioned_in_turn_then_the_question(connector, describe_first, tmp_path,
                                                                       monkeypatch):
  """`a.png<TAB>b.png<TAB>question`: each image followed by the model's own caption of it, then the question, as
  the two-image examples are laid out: the answers equal the generation of the training layout (task.layout)
  with those captions in the targets' places. Flamingo's gates are open, so its text reads the images; the LM's
  weights are drawn at random (_random_lm_weights); EOS, the marker and the question's first piece are never
  generated here, so every caption is task.decoding.max_new_tokens (3) pieces."""
  import jax.numpy as jnp
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "data.num_eval_examples": 8, "task.describe_first": describe_first, "task.decoding.max_new_tokens": 3}
  config = helpers.load_config(f"--config=configs/vlm_digits.py:connector={connector}",
                               *(f"--config.{field}={value}" for field, value in overrides.items()))
  task = vlm_task.VLMTask(config, None, "train")
  question = "which is larger ?"
  never = (*task.tokenizer.never_generated_ids, tokenizers.EOS_ID, task.marker, task.tokenizer.encode(question)[0])
  monkeypatch.setattr(type(task.tokenizer), "never_generated_ids", property(lambda self: never))
  model = task.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
  for block in getattr(model.connector, "blocks", ()):
    for residual in (block.attention_residual, block.mlp_residual):
      residual.gate[...] = jnp.ones_like(residual.gate[...])
  _random_lm_weights(model)
  example = next(e for e in task.eval_examples if len(e.images) == 2)
  paths = [tmp_path / f"{i}.png" for i in range(2)]
  for path, image in zip(paths, example.images):
    Image.fromarray((255 * (1 - image)).astype(np.uint8)).save(path)
  loaded = tuple(vlm_task.image_text.load_image(str(path), task.canvas, grey=True) for path in paths)
  captions, answer = task.infer(model, [f"{paths[0]}\t{paths[1]}\t", f"{paths[0]}\t{paths[1]}\t{question}"])
  alone = task.describe(model, list(loaded))  # each image's caption with nothing before it
  assert captions == " | ".join(alone) and all(alone), captions  # no question: each image captioned alone
  if describe_first:  # the frozen LM answers from the text with each image's description in place
    ids = [task.tokenizer.bos_id]
    for caption in alone:
      ids += task.tokenizer.encode(caption) + [task.marker] + task.tokenizer.encode(caption)
    expected = task.generate(model, [((), ids + task.tokenizer.encode(question), tokenizers.EOS_ID)], text_only=True)
  else:  # each target generated from the training layout's prefix, the ones found before it in place
    expected = []
    for j in range(3):
      texts = expected + ["first"] * (3 - len(expected))  # what follows target j does not reach it
      segments = (("image", 0), ("target", texts[0]), ("image", 1), ("target", texts[1]), ("text", question),
                  ("target", texts[2]))
      layout = task.layout(vlm_digits.VLMExample(images=loaded, segments=segments, kind="larger", num_digits=2))
      prefix, stop, _ = layout.targets[j]
      expected.append(task.generate(model, [(loaded, layout.ids[:prefix].tolist(), stop)])[0])
    assert expected[1] != alone[1], "the second caption reads the first image and its caption too"
  assert answer == (expected[-1] or "(nothing)")
  with pytest.raises(task_lib.InputLineError, match="3 image paths: a line holds at most 2"):
    task.infer(model, [f"{paths[0]}\t{paths[1]}\t{paths[0]}\t{question}"])
  with pytest.raises(task_lib.InputLineError, match="the question holds '<image>', the language model's image"):
    task.infer(model, [f"{paths[0]}\twhat is in <image> ?"])  # it would read as a second image's place
  with pytest.raises(task_lib.InputLineError, match=r"input line 1: the last field, the question, is the file .*: "
                                                    "two images take a question after them"):
    task.infer(model, [f"{paths[0]}\t{paths[1]}"])  # was asked as a question: 32 characters of 'g'
  with pytest.raises(task_lib.InputLineError, match="input line 1: field 1 is an empty image path"):
    task.infer(model, [f"\t{question}"])


def test_training_on_refuses_a_frozen_part_whose_recorded_workdir_now_holds_other_weights(tmp_path):
  """A VLM trained on after another run was trained at its encoder's recorded path (a copied run, whose original
  folder was reused) cached that run's features without a word, while its checkpoints held the encoder it froze."""
  chain = tiny_chain()
  for part in ("encoder", "lm", "vlm"):
    shutil.copytree(chain / part, tmp_path / part)
  record = json.loads((tmp_path / "vlm" / vlm_frozen.FROZEN_RECORD).read_text())
  record.update(encoder_workdir=str(tmp_path / "encoder"), lm_workdir=str(tmp_path / "lm"))
  (tmp_path / "vlm" / vlm_frozen.FROZEN_RECORD).write_text(json.dumps(record))
  config = helpers.load_config(f"--config={tmp_path / 'vlm' / 'config.py'}")
  vlm_task.VLMTask(config, str(tmp_path / "vlm"), "train")  # the runs it froze, moved: read as they were
  _with_a_worse_newer_checkpoint(tmp_path / "encoder", "eval/position_accuracy", -1.0)
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.encoder_workdir=.*holds other weights"):
    vlm_task.VLMTask(config, str(tmp_path / "vlm"), "train")
