"""The translation task: configs, validation, and launch.py train / infer runs in subprocesses."""
import json
import logging
import re
import os
import shutil
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import translate_dates, translate_tsv
from tests import helpers
from xattn_jax.data import batching
from xattn_jax.models import translator
from xattn_jax.training import loop, schedule, task as task_lib, validation
from xattn_jax.tasks.translate import bleu
from xattn_jax.tasks import figure_text
from xattn_jax.tasks.translate import plots as translate_plots
from xattn_jax.tasks.translate import task as translate_task

TINY, DATES = helpers.TINY_TRANSLATOR, helpers.TINY_DATES


def launch(config, workdir, overrides, *extra, stdin=None):
  return helpers.launch(config, workdir, *extra, overrides=overrides, stdin=stdin)


def _config(module=translate_dates, arg=None, **overrides):
  config = module.get_config(arg)
  for key, value in {**DATES, **overrides}.items():
    node = config
    *parents, leaf = key.split(".")
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


@pytest.fixture
def dates_run(trained_translator, tmp_path):
  """A private copy of the session's tiny trained translator (tests may launch into it)."""
  workdir = tmp_path / "dates"
  shutil.copytree(trained_translator, workdir)
  return workdir


def test_both_configs_name_the_translate_task():
  for module in (translate_dates, translate_tsv):
    assert task_lib.get_task_class(module.get_config().task.name) is translate_task.TranslateTask


def test_position_encoding_override_reaches_the_model(tmp_path):
  config = _config(**{"model.position_encoding": "rope", "data.tokenizer": "bytes"})
  model = translate_task.TranslateTask(config, str(tmp_path)).make_model(
      loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  assert model.decoder_blocks.self_attention.rotary.kind == "rope"
  assert model.position_encoding == "rope"


def test_packed_batches_give_each_example_its_unpacked_logits(tmp_path):
  config = _config(**{"data.packing": True, "data.tokenizer": "bytes", "model.max_length": 128,
                      "data.max_source_length": 128, "data.max_target_length": 128})
  task = translate_task.TranslateTask(config, str(tmp_path))
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  batch = task.train_batch(0, process_index=0, process_count=1)
  assert batch["inputs_segmentation"][0].max() >= 2  # row 0 holds several examples
  packed = np.asarray(nnx.jit(task._logits)(model, {k: jnp.asarray(v) for k, v in batch.items()}))
  for segment in (1, 2):  # the first two examples of row 0, each run alone
    source = batch["inputs"][0][batch["inputs_segmentation"][0] == segment]
    in_target = batch["targets_segmentation"][0] == segment
    alone = helpers.Jitted(model)(jnp.asarray(source[None]), jnp.asarray(batch["decoder_inputs"][0][in_target][None]))
    np.testing.assert_allclose(packed[0][in_target], np.asarray(alone[0]), atol=2e-4)


@pytest.mark.parametrize("field, value", [
    ("model.position_encoding", "fourier"),
    ("data.tokenizer", "words"),
    ("data.target_locale", "xx_NOWHERE"),
    ("model.encoder.num_layers", 0),
    ("task.label_smoothing", 1.5),
    ("model.implementation", "flash"),
    ("checkpoint.best_metric", "eval/bleuu"),
    ("task.bleu_tokenize", "ja-mecab"),
    ("data.vocab_size_exact", None),
    ("data.vocab_size", 0),  # reached sentencepiece after the dates were built
    ("data.train_file", "my.tsv"),  # ignored by the generated dates: trained on dates without a word
    ("data.eval_file", "my_eval.tsv"),
])
def test_invalid_fields_are_reported_by_name(field, value):
  with pytest.raises(validation.ConfigError, match=field.replace(".", r"\.")):
    validation.validate_config(_config(**{field: value}))


def test_a_position_encoding_the_translator_cannot_take_is_named_with_its_choices():
  """mrope was refused naming model.decoder.mrope_sections, a field the translator does not have."""
  with pytest.raises(validation.ConfigError, match=r"^config\.model\.position_encoding='mrope': allowed are "
                     + re.escape(repr(sorted(translator.position_encodings())))):
    validation.validate_config(_config(**{"model.position_encoding": "mrope"}))


@pytest.mark.parametrize("module, overrides, message", [
    (translate_dates, {"data.eval_split": "train"}, r"data\.eval_split='train': allowed are"),
    (translate_dates, {"data.test_fraction": 0.0, "data.eval_split": "test"}, r"data\.eval_split='test': reads the test"),
    (translate_dates, {"data.test_fraction": 0.99}, r"data\.test_fraction=0\.99: must be in \[0, 1 - data\.eval_fraction\)"),
    (translate_tsv, {"data.train_file": "x.tsv", "data.eval_split": "test"}, r"data\.eval_split='test': holds out test dates"),
])
def test_the_eval_split_is_checked_before_anything_builds(module, overrides, message):
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(_config(module, **overrides), mode="eval")


def test_dates_evaluate_on_validation_and_score_test_dates_apart(tmp_path):
  """Training evaluates on the validation dates; eval_split=test reads the test dates, never trained on."""
  tasks = {split: translate_task.TranslateTask(_config(**{"data.eval_split": split, "data.tokenizer": "bytes"}),
                                               str(tmp_path / split), mode="eval")
           for split in ("validation", "test")}
  validation_pairs, test_pairs = tasks["validation"].eval_pairs, tasks["test"].eval_pairs
  assert validation_pairs and test_pairs and not set(validation_pairs) & set(test_pairs)
  trained = translate_task.TranslateTask(_config(**{"data.tokenizer": "bytes"}), str(tmp_path / "train"))
  assert not set(trained.train_pairs) & (set(validation_pairs) | set(test_pairs))
  assert trained.eval_pairs == validation_pairs


def test_eval_attention_maps_name_the_side_they_read_so_two_evals_of_a_step_keep_both(tmp_path):
  """--mode=eval draws plots/cross_attention_<split>_K.png (validation and test side by side in one step's folder);
  training keeps plots/cross_attention_K.png, the names the README gives."""
  names = []
  for mode, split in (("eval", "validation"), ("eval", "test"), ("train", "validation")):
    task = translate_task.TranslateTask(_config(**{"data.eval_split": split, "data.tokenizer": "bytes"}),
                                        str(tmp_path / mode), mode=mode)
    task.figure_directory = str(tmp_path / "figures")
    names += [os.path.relpath(path, task.figure_directory) for path in task._attention_plot_paths(1)]
  assert names == [os.path.join("plots", name) for name in (
      "cross_attention_validation_0.png", "cross_attention_test_0.png", "cross_attention_0.png")]


def test_an_eval_file_names_its_figures_by_its_name_and_folder(tmp_path):
  def evaluated(path):
    path.parent.mkdir(exist_ok=True)
    path.write_text("a\tb\n")
    config = _config(translate_tsv, **{"data.train_file": str(path), "data.eval_file": str(path),
                                       "data.tokenizer": "bytes"})
    return translate_task.TranslateTask(config, str(tmp_path), mode="eval").evaluated_name()
  first, second = evaluated(tmp_path / "v1" / "test.tsv"), evaluated(tmp_path / "v2" / "test.tsv")
  assert first.startswith("test.tsv-") and second.startswith("test.tsv-") and first != second


def test_a_dates_config_from_before_the_test_side_trains_on_its_old_split(tmp_path):
  config = _config(**{"data.tokenizer": "bytes"})
  with config.unlocked():
    del config.data["eval_split"], config.data["test_fraction"]
  validation.validate_config(config)
  old = translate_task.TranslateTask(config, str(tmp_path / "old"))
  new = translate_task.TranslateTask(_config(**{"data.tokenizer": "bytes"}), str(tmp_path / "new"))
  assert old.eval_pairs == new.eval_pairs and len(old.train_pairs) > len(new.train_pairs)


def test_rope_scaling_factor_must_be_positive():
  config = _config(**{"model.position_encoding": "rope", "model.rope_scaling": "ntk", "model.rope_scaling_factor": 0.0})
  with pytest.raises(validation.ConfigError, match=r"model\.rope_scaling_factor"):
    validation.validate_config(config)


def test_cudnn_on_a_cpu_backend_is_refused_once_the_backend_is_known():
  config = _config(**{"model.implementation": "cudnn", "precision.compute_dtype": "bfloat16"})
  validation.validate_config(config)  # before jax.distributed.initialize: the backend is not asked
  with pytest.raises(validation.ConfigError, match=r"model\.implementation.*GPU"):
    validation.validate_config(config, device_count=1)


def test_cudnn_with_float32_compute_is_refused_before_compiling():
  config = _config(**{"model.implementation": "cudnn"})
  with pytest.raises(validation.ConfigError, match=r"model\.implementation.*compute_dtype bfloat16 or float16"):
    validation.validate_config(config)


# --- decoding options and randomized positions -----------------------------------------------------

def _infer_task(tmp_path, **decoding):
  """An infer-mode task (bytes: no tokenizer file needed) decoding up to 12 tokens as `decoding` says."""
  overrides = {"data.tokenizer": "bytes", "task.max_decode_length": 12,
               **{f"task.decoding.{k}": v for k, v in decoding.items()}}
  return translate_task.TranslateTask(_config(**overrides), str(tmp_path), mode="infer")


def test_sampled_translations_with_a_fixed_seed_repeat_and_differ_from_greedy(tmp_path):
  lines = ["Jan 4, 2001", "February 5, 2000", "Monday, January 3, 2000"]
  sampler = _infer_task(tmp_path, method="sample", temperature=20.0, seed=3)
  model = sampler.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)  # untrained
  sampled = sampler.infer(model, lines)
  assert sampler.infer(model, lines) == sampled
  greedy = _infer_task(tmp_path, method="greedy").infer(model, lines)
  assert len(sampled) == len(greedy) == 3 and sampled != greedy
  # a line samples by its own number: after a blank line as after another line (it took the blank's key before)
  assert sampler.infer(model, ["", lines[1]])[1] == sampler.infer(model, lines[:2])[1] == sampled[1]


def test_a_top_k_keeping_the_whole_vocabulary_is_said(tmp_path, caplog):
  caplog.set_level(logging.WARNING)
  _infer_task(tmp_path, method="sample", top_k=300)  # bytes: 259 tokens
  assert any("task.decoding.top_k=300 keeps every one of the vocabulary's" in r.getMessage() for r in caplog.records)
  caplog.clear()
  _infer_task(tmp_path, method="sample", top_k=40)
  assert not [r for r in caplog.records if "top_k" in r.getMessage()]


def test_infer_strips_a_line_and_crops_an_over_long_one_answering_every_line(tmp_path, caplog):
  """One line past model.max_length stopped the whole batch (nothing written for the lines before it); spaces
  around a line, absent from the training pairs, changed its translation."""
  caplog.set_level(logging.WARNING)
  task = _infer_task(tmp_path)
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)  # untrained
  limit = task.config.model.max_length
  long_line = "1" * (limit + 20)  # bytes: one token a character
  answers = task.infer(model, ["Jan 4, 2001", "", long_line, "  Jan 4, 2001 \t"])
  assert len(answers) == 4 and answers[1] == "" and answers[3] == answers[0]
  assert answers[2] == task.infer(model, [long_line[:limit]])[0]
  assert any(f"1 line(s) hold more tokens than the model's sources take (model.max_length={limit}): each is "
             f"translated from its first {limit} tokens (line 3: {limit + 20} tokens)"
             in record.getMessage() for record in caplog.records)


def test_an_infer_line_holding_a_tab_is_refused_not_translated_with_its_target(tmp_path):
  """A pairs file piped into infer was answered with translations of 'source ⁇ target' (the tab an unknown
  piece), exit 0."""
  task = _infer_task(tmp_path)
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)  # untrained
  with pytest.raises(task_lib.InputLineError) as error:
    task.infer(model, ["Jan 4, 2001", "Jan 4, 2001\t2001-01-04", "\tJan 5, 2001 "])
  assert [index for index, _ in error.value.problems] == [1] and "holds a tab" in error.value.problems[0][1]


def test_infer_never_writes_a_suppressed_id_even_where_the_model_ranks_it_first(tmp_path):
  """The output layer ranks padding, BOS and the bytes of line breaks (never_generated_ids) above every other
  id, 'x' next: infer (the config's decoding method) translates every line to 'x's alone."""
  overrides = {"data.tokenizer": "bytes", "task.max_decode_length": 12, "model.tie_output": False}
  task = translate_task.TranslateTask(_config(**overrides), str(tmp_path), mode="infer")
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  never = list(task.tokenizer.never_generated_ids)
  assert len(never) >= 4  # padding, BOS, "\n", "\r"
  preference = np.zeros(model.output.bias[...].shape, np.float32)  # the logits of every position
  preference[never], preference[task.tokenizer.encode("x")] = 60.0, 30.0
  model.output.kernel[...] = jnp.zeros_like(model.output.kernel[...])
  model.output.bias[...] = jnp.asarray(preference)
  assert task.infer(model, ["Jan 4, 2001", "May 1, 2000"]) == ["x" * 12] * 2


@pytest.mark.parametrize("field, value", [("method", "nucleus"), ("temperature", 0.0), ("top_p", 1.5),
                                          ("top_k", -1), ("beam_size", 0), ("alpha", -0.5), ("seed", -1)])
def test_a_bad_decoding_option_is_one_config_error_line_naming_it(field, value):
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(_config(**{f"task.decoding.{field}": value}), mode="infer")
  assert error.value.field == f"task.decoding.{field}"
  assert len(str(error.value).splitlines()) == 1


def test_the_old_beam_size_field_is_a_config_error_naming_where_it_moved():
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.beam_size=2: moved to task\.decoding\.beam_size"):
    validation.validate_config(_config(**{"task.beam_size": 2}))


def test_randomized_positions_reach_both_sides_of_the_translator(tmp_path):
  config = _config(**{"data.tokenizer": "bytes", "model.randomized_positions_max": 128,
                      "model.randomized_positions_at_eval": True})
  validation.validate_config(config)
  task = translate_task.TranslateTask(config, str(tmp_path))
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  for side in (model.source_positions, model.target_positions):
    assert (side.randomized.max_position, side.randomized.at_eval) == (128, True)
  batch = {k: jnp.asarray(v) for k, v in task.train_batch(0, process_index=0, process_count=1).items()}
  loss = nnx.jit(lambda model, batch, key: task.loss(model, batch, rngs=nnx.Rngs(key))[0])
  losses = [float(loss(model, batch, jax.random.key(seed))) for seed in (0, 0, 1)]
  assert losses[0] == losses[1] != losses[2]


@pytest.mark.parametrize("overrides, field", [
    ({"model.randomized_positions_max": 16}, "model.randomized_positions_max"),  # < model.max_length 32
    ({"model.randomized_positions_max": 128, "data.packing": True}, "model.randomized_positions_max"),
    # a grid encoding, which the translator does not build, is named first (Task.position_encodings)
    ({"model.randomized_positions_max": 128, "model.position_encoding": "rope_2d"}, "model.position_encoding")])
def test_bad_randomized_positions_for_the_translator_are_a_config_error_naming_the_field(overrides, field):
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(_config(**overrides))
  assert error.value.field == field


@pytest.mark.slow
def test_dates_run_logs_translation_metrics_and_attention_maps(dates_run):
  workdir = dates_run
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  eval_row = [row for row in rows if "eval/bleu" in row][-1]
  for name in ("eval/loss", "eval/accuracy", "eval/exact_match", "eval/bleu", "eval/chrf"):
    assert name in eval_row
  assert (workdir / "plots" / "cross_attention_0.png").stat().st_size > 0
  assert (workdir / translate_task.SPM_FILE).is_file()


@pytest.mark.slow
def test_infer_prints_one_line_per_input_and_reuses_the_tokenizer(dates_run):
  workdir = dates_run
  tokenizer = workdir / translate_task.SPM_FILE
  before = tokenizer.stat().st_mtime_ns
  lines = "Monday, January 3, 2000\nJan 4, 2001\nFebruary 5, 2000\n"
  result = launch("configs/translate_dates.py", workdir, DATES, "--mode=infer", stdin=lines)
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(result.stdout.splitlines()) == 3 and "no piece for" not in result.stderr
  assert tokenizer.stat().st_mtime_ns == before
  # A character the tokenizer never saw reads as its unknown piece: translated, and said.
  result = launch("configs/translate_dates.py", workdir, DATES, "--mode=infer", stdin="Jan 4, 2001 \u2603\n")
  assert result.returncode == 0 and len(result.stdout.splitlines()) == 1, result.stderr[-3000:]
  assert "the input lines hold characters the tokenizer has no piece for: '\u2603'" in result.stderr


@pytest.mark.slow
def test_infer_may_decode_differently_but_training_may_not_change_the_data(dates_run):
  workdir = dates_run
  # beam search, reading the sinusoidal run at twice its trained model.max_length (a parameter-free field)
  beam = launch("configs/translate_dates.py", workdir, {**DATES, "task.decoding.method": "beam",
                                                         "task.decoding.beam_size": 2, "model.max_length": 64},
                "--mode=infer", stdin="Jan 4, 2001\n")
  assert beam.returncode == 0 and len(beam.stdout.splitlines()) == 1, beam.stderr[-3000:]
  german = launch("configs/translate_dates.py", workdir, {**DATES, "data.target_locale": "de"})
  assert german.returncode == 2 and "data.target_locale" in german.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.slow
def test_a_user_corpus_trains_for_its_passes_resumes_exactly_after_sigterm_and_evaluates_without_its_files(tmp_path):
  """The tsv config trains for as many passes over a user's corpus as max_epochs asks (40 pairs, batches of 8: 5
  steps a pass; step 10 of total_steps 40), and that end and the learning-rate decay toward it hold across a SIGTERM
  and a restart: the same losses, the same end, the same final eval. Then evaluation needs the run's workdir and the
  eval file, inference only the workdir."""
  (tmp_path / "train.tsv").write_text("".join(f"{n} cats\t{n} chats\n" for n in range(40)))
  (tmp_path / "eval.tsv").write_text("41 cats\t41 chats\n")
  overrides = {**TINY, "data.train_file": tmp_path / "train.tsv", "data.eval_file": tmp_path / "eval.tsv",
               "data.tokenizer": "bytes", "total_steps": 40, "max_epochs": 2.0, "min_steps": 0,
               "log_every_steps": 1, "eval_every_steps": 5, "checkpoint.every_steps": 5, "steps_per_call": 1}
  reference = launch("configs/translate_tsv.py", tmp_path / "reference", overrides)
  assert reference.returncode == 0, reference.stderr[-3000:]
  workdir = tmp_path / "interrupted"
  process = helpers.start(helpers.launch_command("configs/translate_tsv.py", workdir,
                                                 overrides={**overrides, "debug.step_delay_s": 0.3}),
                          env=helpers.subprocess_env())
  deadline = time.time() + 240
  while not ((workdir / "metrics.jsonl").exists() and len(helpers.metric_rows(workdir)) >= 3):
    assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=240)
  stopped_at = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert process.returncode == 0 and stopped_at < 10, stderr[-3000:]
  resumed = launch("configs/translate_tsv.py", workdir, overrides)
  assert resumed.returncode == 0 and f"Resuming from checkpoint step {stopped_at}" in resumed.stderr, \
      resumed.stderr[-3000:]

  def losses_and_last_eval(run):
    rows = helpers.metric_rows(run)
    last_eval = [r for r in rows if "eval/loss" in r][-1]
    return ({r["step"]: r["train/loss"] for r in rows if "train/loss" in r},
            {k: v for k, v in last_eval.items() if k == "step" or k.startswith("eval/")})
  (losses, last_eval), (reference_losses, reference_eval) = map(losses_and_last_eval, (workdir, tmp_path / "reference"))
  assert losses == reference_losses and sorted(losses) == list(range(1, 11))
  assert last_eval == reference_eval and last_eval["step"] == 10 and "eval/chrf" in last_eval
  run = tmp_path / "reference"
  assert json.loads((run / "config.json").read_text())["total_steps"] == 40  # as written
  fewer = launch("configs/translate_tsv.py", run, {**overrides, "max_epochs": 1.0})  # ends at 5
  assert fewer.returncode == 2 and "config.max_epochs=1.0: its passes end at step 5, but the run in" in fewer.stderr, \
      fewer.stderr[-3000:]
  (tmp_path / "train.tsv").unlink()
  evaluated = helpers.launch(run / "config.py", run, "--mode=eval")
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  (tmp_path / "eval.tsv").unlink()
  answer = helpers.launch(run / "config.py", run, "--mode=infer", stdin="7 cats\n")
  assert answer.returncode == 0 and len(answer.stdout.splitlines()) == 1, answer.stderr[-3000:]


def test_the_tsv_default_budget_grows_with_the_corpus_from_the_dates_1200_steps():
  """1,200 steps of 64 pairs were a fraction of a pass over a large corpus: now 20 passes, at least 1,200
  steps (a small corpus trains as before), at most 10,000."""
  config = translate_tsv.get_config()
  small, large, huge = (batching.steps_per_epoch(pairs, config.batch_size) for pairs in (1_103, 20_000, 100_000))
  assert [schedule.end_step(config, steps) for steps in (small, large, huge)] == [1200, 20 * 312, 10_000]
  assert schedule.end_step(translate_tsv.get_config("epochs=0"), large) == 10_000


def test_each_eval_decodes_its_share_of_pairs_evenly_spaced_through_the_file_and_scores_them_aligned(tmp_path):
  """A file sorted by date or length is sampled from end to end (the first N of the dates' chronological eval
  pairs were all from their first years); the hypotheses are those of the pairs scored. The TSV default decodes
  1,000 pairs an eval in training; --mode=eval decodes them all."""
  (tmp_path / "train.tsv").write_text("".join(f"{n} cats\t{n} chats\n" for n in range(40)))
  (tmp_path / "eval.tsv").write_text("".join(f"{n} dogs\t{n} dogs\n" for n in range(10)))
  config = _config(translate_tsv, **{"data.train_file": str(tmp_path / "train.tsv"), "task.num_decode_examples": 4,
                                     "data.eval_file": str(tmp_path / "eval.tsv"), "data.tokenizer": "bytes",
                                     "task.num_attention_plots": 0})
  task = translate_task.TranslateTask(config, str(tmp_path))
  assert [source for source, _ in task._decoded_pairs] == ["0 dogs", "3 dogs", "6 dogs", "9 dogs"]
  decoded = []
  task.translate_ids = lambda model, inputs, limit: decoded.append(inputs) or [  # echoes each source: its target
      task.tokenizer.decode([int(i) for i in row if i]) for row in inputs]
  assert task.extra_eval(None)["exact_match"] == 1.0 and len(decoded[0]) == 4
  final = translate_task.TranslateTask(config, str(tmp_path), mode="eval")  # the final score reads every pair
  assert [source for source, _ in final._decoded_pairs] == [f"{n} dogs" for n in range(10)]
  config.task.num_decode_examples = 0
  assert len(translate_task.TranslateTask(config, str(tmp_path))._decoded_pairs) == 10
  assert translate_tsv.get_config().task.num_decode_examples == 1000


def test_a_few_rows_decode_in_a_batch_of_their_own_size_not_padded_to_the_eval_batch(tmp_path):
  """Two lines of infer ran a beam search over 256 rows (eval_batch_size): 100x the time, and with a wide beam
  the memory of the machine."""
  (tmp_path / "train.tsv").write_text("".join(f"{n} cats\t{n} chats\n" for n in range(40)))
  config = _config(translate_tsv, **{"data.train_file": str(tmp_path / "train.tsv"), "data.tokenizer": "bytes",
                                     "eval_batch_size": 256})
  task = translate_task.TranslateTask(config, str(tmp_path))
  shapes = []
  task._generate = lambda model, inputs, **kwargs: shapes.append(inputs.shape) or inputs
  for rows in (2, 3, 300):
    assert len(task.translate_ids(None, np.ones((rows, 5), np.int32), 8)) == rows
  assert shapes == [(2, 5), (4, 5), (256, 5), (256, 5)]


def test_a_tsv_corpus_without_an_eval_file_holds_out_a_share_of_its_sources(tmp_path):
  """A user's one parallel file was refused ('data.eval_file is required'): now 5% of its sources are held out,
  every pair of such a source with them; --mode=eval holds out the same pairs; an eval pair too long for the
  model is named by its line in the training file."""
  lines = [f"{n % 300} cats\t{n % 300} chats" + " !" * (n >= 300) for n in range(600)]  # each source twice
  (tmp_path / "train.tsv").write_text("".join(line + "\n" for line in lines))
  config = _config(translate_tsv, **{"data.train_file": str(tmp_path / "train.tsv"), "data.eval_file": "",
                                     "data.tokenizer": "bytes", "task.num_attention_plots": 0})
  validation.validate_config(config)
  trained = translate_task.TranslateTask(config, str(tmp_path))
  held = {source for source, _ in trained.eval_pairs}
  assert not held & {source for source, _ in trained.train_pairs}
  assert len(trained.eval_pairs) == 2 * len(held) and 0.02 < len(held) / 300 < 0.1
  assert len(trained.train_pairs) + len(trained.eval_pairs) == 600
  validation.validate_config(config, mode="eval")
  assert translate_task.TranslateTask(config, str(tmp_path), mode="eval").eval_pairs == trained.eval_pairs
  config.data.eval_fraction = 0.0
  with pytest.raises(validation.ConfigError, match=r"^config\.data\.eval_fraction=0\.0: must be in \(0, 1\)"):
    validation.validate_config(config)
  (tmp_path / "one.tsv").write_text("hello\tbonjour\nhello\tsalut\n")  # one source: nothing to hold out
  config.data.eval_fraction, config.data.train_file = 0.05, str(tmp_path / "one.tsv")
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.data\.eval_file='': no eval pairs: .*one distinct source"):
    translate_task.TranslateTask(config, str(tmp_path / "one"))
  index = next(i for i, line in enumerate(lines) if line.split("\t")[0] in held)  # (the key is the source)
  lines[index] += " chats" * 10
  (tmp_path / "train.tsv").write_text("".join(line + "\n" for line in lines))
  config = _config(translate_tsv, **{"data.train_file": str(tmp_path / "train.tsv"), "data.eval_file": "",
                                     "data.tokenizer": "bytes", "model.max_length": 32})
  with pytest.raises(validation.ConfigError, match=rf"train\.tsv:{index + 1}: an eval example"):
    translate_task.TranslateTask(config, str(tmp_path / "long"))


def test_length_bucketed_batches_of_several_shapes_train_as_at_one_step_per_call(tmp_path):
  """Bucketed batches change shape from step to step; a call stacks only batches of one shape (the
  stack of different shapes crashed), and the losses are those of one step per call."""
  # Two shapes, (8, 8) and (16, 16) tokens after bucketing: each call of 4 steps is cut where the shape changes.
  corpus = "".join(f"{n}{' cats cats' * (n % 2)}\t{n}{' chats chats' * (n % 2)}\n" for n in range(64))
  (tmp_path / "train.tsv").write_text(corpus)
  (tmp_path / "eval.tsv").write_text("70 cats\t70 chats\n")
  losses = []
  for steps_per_call in (1, 4):
    overrides = {**TINY, "data.train_file": tmp_path / "train.tsv", "data.eval_file": tmp_path / "eval.tsv",
                 "data.tokenizer": "bytes", "data.length_bucketing": True, "total_steps": 8, "log_every_steps": 1,
                 "eval_every_steps": 8, "checkpoint.every_steps": 8, "steps_per_call": steps_per_call}
    workdir = tmp_path / f"work{steps_per_call}"
    result = launch("configs/translate_tsv.py", workdir, overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses.append([row["train/loss"] for row in rows])
  assert len(losses[0]) == 8
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def test_bleu_of_exact_translations_is_100_in_scripts_written_without_spaces():
  """sacrebleu's default 13a tokenizer splits at spaces only: exact Chinese, Japanese or Thai
  translations scored BLEU 0 (no 2- to 4-grams). "auto" picks the character tokenizer for them."""
  import sacrebleu
  for references in (["一五", "五七", "五五九〇二"], ["にじゅうきゅうにち", "十一月二十九日"],
                     ["หนึ่งสอง", "สามสี่ห้า"]):
    assert bleu.bleu_tokenizer(references) == "char"
    assert sacrebleu.corpus_bleu(references, [references], tokenize="char").score == pytest.approx(100)
  assert bleu.bleu_tokenizer(["dimanche 29 novembre 2026", "29 nov. 2026"]) == "13a"
  assert bleu.bleu_tokenizer(["29 ноября 2026 г."]) == "13a"
  assert bleu.bleu_tokenizer(["一五"], "13a") == "13a"  # an explicit choice wins


def _tsv_task(tmp_path, train_lines, eval_lines, **overrides):
  (tmp_path / "train.tsv").write_text("".join(line + "\n" for line in train_lines))
  (tmp_path / "eval.tsv").write_text("".join(line + "\n" for line in eval_lines))
  config = _config(translate_tsv, **{"data.train_file": str(tmp_path / "train.tsv"),
                                     "data.eval_file": str(tmp_path / "eval.tsv"), "data.tokenizer": "bytes",
                                     **overrides})
  return translate_task.TranslateTask(config, str(tmp_path))


def test_training_rows_never_exceed_model_max_length(tmp_path, caplog):
  # model.max_length is 32 bytes here; one training line is 80: it is truncated, with a warning naming its line.
  caplog.set_level(logging.WARNING)
  task = _tsv_task(tmp_path, [f"{n} cats\t{n} chats" for n in range(20)] + ["x" * 80 + "\ty"], ["1 cat\t1 chat"])
  assert task.train_batches.max_source_length == 32
  assert any(re.search(r"1 of the 21 training pairs are longer than the rows \(tokens, the target's EOS included: "
                       r"source 32, within model.max_length=32; target \d+, within model.max_length=32\) and are "
                       r"cropped to them: .*train.tsv:21$", record.getMessage()) for record in caplog.records)
  assert task.train_batch(0, process_index=0, process_count=1)["inputs"].shape[1] <= 32


def test_an_eval_of_training_pairs_says_its_scores_are_not_held_out(tmp_path, caplog):
  """Training warned; --mode=eval of the same pairs reported exact match 1.0 as a held-out score."""
  caplog.set_level(logging.WARNING)
  _tsv_task(tmp_path, [f"{n} cats\t{n} chats" for n in range(20)], ["3 cats\t3 chats", "30 cats\t30 chats"])
  config = _config(translate_tsv, **{"data.train_file": str(tmp_path / "train.tsv"),
                                     "data.eval_file": str(tmp_path / "eval.tsv"), "data.tokenizer": "bytes"})
  caplog.clear()
  translate_task.TranslateTask(config, str(tmp_path), mode="eval")
  assert any(f"1 of the 2 eval sources in {tmp_path / 'eval.tsv'} are also training sources in "
             f"{tmp_path / 'train.tsv'}" in record.getMessage() for record in caplog.records)


def test_an_eval_line_longer_than_model_max_length_stops_before_training_naming_file_and_line(tmp_path):
  with pytest.raises(validation.ConfigError, match=r"model\.max_length.*eval\.tsv:2: .*40 source"):
    _tsv_task(tmp_path, ["1 cat\t1 chat"], ["2 cats\t2 chats", "x" * 40 + "\ty"])


def test_a_corpus_is_parsed_once_per_run_and_again_when_it_changes(tmp_path, monkeypatch):
  # The config check and the task both read the corpus; an unchanged file is parsed once.
  corpus = tmp_path / "train.tsv"
  corpus.write_text("one\tun\ntwo\tdeux\n")
  parsed = []
  read = translate_task.tsv.read_parallel_tsv
  monkeypatch.setattr(translate_task.tsv, "read_parallel_tsv", lambda path: parsed.append(path) or read(path))
  translate_task._parse_tsv.cache_clear()
  first = translate_task._read_tsv("data.train_file", str(corpus))
  assert translate_task._read_tsv("data.train_file", str(corpus)) == first == (("one", "un"), ("two", "deux"))
  assert len(parsed) == 1
  corpus.write_text("one\tun\ntwo\tdeux\nthree\ttrois\n")  # a new size: read again
  assert translate_task._read_tsv("data.train_file", str(corpus))[-1] == ("three", "trois")
  assert len(parsed) == 2


def test_tsv_config_rejects_a_malformed_line_with_file_and_line(tmp_path):
  train = tmp_path / "train.tsv"
  train.write_text("one\tun\ntwo deux\nthree\ttrois\n")
  (tmp_path / "eval.tsv").write_text("four\tquatre\n")
  result = launch("configs/translate_tsv.py", tmp_path / "work",
                  {"data.train_file": train, "data.eval_file": tmp_path / "eval.tsv"})
  assert result.returncode == 2
  assert f"{train}:2" in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
  assert not (tmp_path / "work" / "checkpoints").exists()


def _assert_one_line_exit_2_and_no_workdir(result, workdir, *expected):
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert all(text in lines[0] for text in expected), lines[0]
  assert not workdir.exists()  # not even the config of a run that never started


def test_corpus_too_small_for_an_exact_vocabulary_is_one_line_naming_the_field_and_file(tmp_path):
  train = tmp_path / "train.tsv"
  train.write_text("one\tun\ntwo\tdeux\nthree\ttrois\nfour\tquatre\nfive\tcinq\n")
  (tmp_path / "eval.tsv").write_text("six\tsix\n")
  workdir = tmp_path / "work"
  result = launch("configs/translate_tsv.py", workdir, {"data.train_file": train,
                                                        "data.eval_file": tmp_path / "eval.tsv",
                                                        "data.vocab_size_exact": True})
  _assert_one_line_exit_2_and_no_workdir(result, workdir, "config.data.vocab_size=4000", str(train),
                                         "data.vocab_size_exact=False")


def test_default_vocab_size_is_a_cap_that_a_small_corpus_trains_under(tmp_path):
  """translate_tsv's 4000 pieces stopped a run on any corpus that could not fill them."""
  task = _tsv_task(tmp_path, [f"{n} cats\t{n} chats" for n in range(30)], ["1 cat\t1 chat"],
                   **{"data.tokenizer": "sentencepiece"})
  assert 40 < task.vocab_size < 4000


def test_a_corpus_smaller_than_a_batch_trains_on_repeated_pairs_and_says_so(tmp_path, caplog):
  """Three pairs at the default batch_size of 64 once stopped the run ("lower batch_size"): a user's small
  corpus now trains at default settings, each batch repeating every pair, with one warning saying so."""
  caplog.set_level(logging.WARNING)
  task = _tsv_task(tmp_path, ["hello\tbonjour", "thank you\tmerci", "good night\tbonne nuit"],
                   ["good morning\tbonjour"], **{"data.packing": False,
                                                  "batch_size": translate_tsv.get_config().batch_size})
  inputs = task.train_batch(5, process_index=0, process_count=1)["inputs"]
  assert inputs.shape[0] == task.config.batch_size == 64
  assert len({row.tobytes() for row in inputs}) == 3
  assert any("gives 3 training examples, fewer than batch_size=64: every batch holds each of them 21 or 22 times"
             in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("bucketing", [False, True])
def test_one_long_pair_that_makes_most_slots_padding_is_said_with_the_remedies(tmp_path, caplog, bucketing):
  """A 400-word pair padded every row to 256 tokens: 50x slower steps, with only a truncation warning."""
  caplog.set_level(logging.WARNING)
  pairs = [f"{n} cats\t{n} chats" for n in range(40)]
  _tsv_task(tmp_path, pairs + [" ".join(["word"] * 60) + "\tmot"], ["1 cat\t1 chat"],
            **{"data.length_bucketing": bucketing, "model.max_length": 128})
  said = [r.getMessage() for r in caplog.records if "the token slots of each example" in r.getMessage()]
  assert len(said) == (0 if bucketing else 1)
  assert bucketing or "data.length_bucketing=True" in said[0]
  caplog.clear()
  (tmp_path / "short").mkdir()
  _tsv_task(tmp_path / "short", pairs, ["1 cat\t1 chat"], **{"model.max_length": 128})  # rows at the minimal length: nothing to say
  assert not [r for r in caplog.records if "the token slots of each example" in r.getMessage()]


def test_an_unknown_date_format_is_one_line_naming_the_field(tmp_path):
  workdir = tmp_path / "work"
  result = launch("configs/translate_dates.py", workdir, {"data.formats": "full,bogus"})
  _assert_one_line_exit_2_and_no_workdir(result, workdir, "config.data.formats='full,bogus'", "'medium'")


@pytest.mark.parametrize("per_head, panels", [(False, 2), (True, 6)])
def test_attention_plot_has_one_panel_per_layer_or_per_layer_and_head(tmp_path, per_head, panels):
  weights = np.random.default_rng(0).dirichlet(np.ones(4), size=(2, 3, 5))  # -> [layers, heads, t, s]
  path = tmp_path / "attention.png"
  figure = translate_plots.plot_cross_attention(weights, list("abcd"), list("vwxyz"), path, per_head=per_head)
  assert path.stat().st_size > 0
  assert len(figure.axes) == panels
  translate_plots.close(figure)


def test_attention_plot_of_characters_no_font_has_writes_them_escaped_without_warnings(tmp_path):
  import warnings
  fonts = figure_text.installed_fonts()[1]
  missing = [c for c in "日曜日🙂" if not any(font.get_char_index(ord(c)) for font in fonts)]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # matplotlib's "Glyph ... missing from font" is a UserWarning
    figure = translate_plots.plot_cross_attention(np.full((1, 1, 2, 2), 0.5), ["日曜日", "a"], ["🙂", "b"],
                                                  tmp_path / "map.png")
  labels = [t.get_text() for t in figure.axes[0].get_xticklabels() + figure.axes[0].get_yticklabels()]
  translate_plots.close(figure)
  for c in missing:
    assert any(f"\\u{ord(c):04x}" in label for label in labels)


def test_attention_plot_rejects_weights_that_do_not_match_the_pieces(tmp_path):
  with pytest.raises(ValueError, match="target by source"):
    translate_plots.plot_cross_attention(np.ones((1, 1, 3, 4)), list("abc"), list("xyz"), tmp_path / "a.png")


@pytest.mark.parametrize("field, value, rule", [
    ("data.formats", "full,bogus", "comma-separated distinct names from"),
    ("data.formats", "full,full", "comma-separated distinct names from"),
    ("data.first_year", 2100, "must be <= data.last_year"),
    ("data.last_year", 10000, "must be an integer year in 1..9999"),
    ("data.eval_fraction", 0.0, "must be in (0, 1)"),  # used to fail later: "examples must be non-empty"
])
def test_date_data_fields_are_checked_before_the_dates_are_made(field, value, rule):
  with pytest.raises(validation.ConfigError, match=rf"^config\.{re.escape(field)}=.*{re.escape(rule)}"):
    validation.validate_config(_config(**{field: value}))


def test_fine_tuning_from_init_from_keeps_that_runs_tokenizer(dates_run, tmp_path):
  """A tokenizer trained on the new corpus gave the same pieces other ids, so every embedding row of
  the initialising checkpoint was read for the wrong piece. The run's tokenizer is now copied in;
  a workdir that already holds another tokenizer is refused."""
  source_run = dates_run
  source = source_run / "tokenizer" / "sentencepiece.model"
  config = _config(arg="locale=de", **{"init_from": str(source_run / "checkpoints")})
  task = translate_task.TranslateTask(config, str(tmp_path / "new"))
  assert (tmp_path / "new" / "tokenizer" / "sentencepiece.model").read_bytes() == source.read_bytes()
  assert task.vocab_size == translate_task.TranslateTask(_config(), str(source_run)).vocab_size

  other = tmp_path / "other"
  translate_task.TranslateTask(_config(arg="locale=de"), str(other))  # trains its own tokenizer
  with pytest.raises(validation.ConfigError, match=r"config\.init_from=.*differs from this workdir's"):
    translate_task.TranslateTask(config, str(other))


def test_a_fine_tune_whose_init_from_run_is_gone_keeps_the_tokenizer_it_copied_in(dates_run, tmp_path, caplog):
  """Resumed once the run it started from was deleted, a fine-tune on text its inherited vocabulary cannot fully
  encode (German's "ä") was refused as a workdir's leftover tokenizer of another corpus ("use a new --workdir")."""
  source_run = tmp_path / "source"
  shutil.copytree(dates_run, source_run)
  config = _config(arg="locale=de", **{"init_from": str(source_run / "checkpoints")})
  workdir = tmp_path / "fine_tune"
  caplog.set_level(logging.WARNING)
  translate_task.TranslateTask(config, str(workdir))
  assert any("The tokenizer of init_from's run" in r.getMessage() for r in caplog.records)  # what it cannot encode
  shutil.rmtree(source_run)
  caplog.clear()
  translate_task.TranslateTask(config, str(workdir))  # resumed: not refused
  assert any("The tokenizer of init_from's run" in r.getMessage() for r in caplog.records)


def test_a_kept_tokenizer_of_another_corpus_is_refused(tmp_path):
  """The tokenizer an earlier attempt in the same workdir trained on another corpus was reused: silently where it
  encoded the new one (a run on part of the corpus kept the whole corpus's pieces), with unknowns where not."""
  lines, sentencepiece = [f"{n} cats\t{n} chats" for n in range(30)], {"data.tokenizer": "sentencepiece",
                                                                       "data.vocab_size": 40}
  _tsv_task(tmp_path, lines, ["1 cat\t1 chat"], **sentencepiece)
  _tsv_task(tmp_path, lines, ["1 cat\t1 chat"], **sentencepiece)  # the same corpus: reused
  with pytest.raises(validation.ConfigError, match=r"config\.data\.train_file=.*train.tsv': existing SentencePiece "
                                                   r"model .* was trained on other text \(60 texts, not these 20\)"):
    _tsv_task(tmp_path, lines[:10], ["1 cat\t1 chat"], **sentencepiece)
  # a run with checkpoints resumes on an edited corpus with the model they read (the loop warns of the edit)
  (tmp_path / "checkpoints" / "8").mkdir(parents=True)
  _tsv_task(tmp_path, lines[:10], ["1 cat\t1 chat"], **sentencepiece)
  shutil.rmtree(tmp_path / "checkpoints")
  (tmp_path / "tokenizer" / "sentencepiece.model.texts").unlink()  # a model written before digests were kept
  with pytest.raises(validation.ConfigError, match=r"cannot encode \['Z', .*e\.g\. 'Zebra'"):
    _tsv_task(tmp_path, lines + ["Zebra\tZèbre"], ["1 cat\t1 chat"], **sentencepiece)


def test_eval_lines_that_are_training_lines_are_reported(tmp_path, caplog):
  lines = [f"{n} cats\t{n} chats" for n in range(20)]
  _tsv_task(tmp_path, lines, lines[:5] + ["99 dogs\t99 chiens"])
  assert any("5 of the 6 eval sources" in r.getMessage() for r in caplog.records)


def test_init_from_a_checkpoint_of_another_model_is_one_line(dates_run, tmp_path):
  source_run = dates_run
  workdir = tmp_path / "work"
  result = launch("configs/translate_dates.py", workdir, {**DATES, "model.encoder.d_model": 48,
                                                           "model.decoder.d_model": 48,
                                                           "init_from": source_run / "checkpoints"})
  assert result.returncode == 2, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert "init_from checkpoint" in last and "holds another model" in last and "Traceback" not in result.stderr
