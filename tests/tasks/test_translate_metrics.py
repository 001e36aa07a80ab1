"""What the translate task's eval metrics measure on a corpus, and where BLEU is undefined for it."""
import logging
import os
import sys
from pathlib import Path

import pytest

from configs import translate_tsv
from tests import helpers
from xattn_jax.tasks.translate import bleu, task as translate_task
from xattn_jax.training import loop, validation

REPO = Path(__file__).resolve().parents[2]

# English numbers -> German numerals, written as one word each (the targets have no spaces).
COMPOUND_WORDS = [
    ("forty-one thousand, nine hundred and eighty-two", "einundvierzigtausendneunhundertzweiundachtzig"),
    ("three thousand, seven hundred and eleven", "dreitausendsiebenhundertelf"),
    ("ninety-nine", "neunundneunzig"), ("two hundred and one", "zweihunderteins"),
    ("five thousand and fifty", "fünftausendfünfzig"), ("sixty-three", "dreiundsechzig"),
    ("one hundred and twenty", "einhundertzwanzig"), ("eight thousand, four hundred", "achttausendvierhundert"),
    ("seventeen", "siebzehn"), ("thirty-four", "vierunddreißig"), ("nine hundred and ninety", "neunhundertneunzig"),
]
SENTENCES = ["the cat sat on the mat", "a dog ran across the road today", "it rained all night long, again"]
TINY = {"total_steps": 2, "batch_size": 4, "eval_batch_size": 4, "log_every_steps": 1, "eval_every_steps": 2,
        "checkpoint.every_steps": 2, "optimizer.warmup_steps": 1, "logging.tensorboard": False,
        "data.tokenizer": "bytes", "model.max_length": 64, "task.num_attention_plots": 0,
        "model.encoder.d_model": 16, "model.encoder.num_layers": 1, "model.encoder.mlp_dim": 32,
        "model.decoder.d_model": 16, "model.decoder.num_layers": 1, "model.decoder.mlp_dim": 32}


def _config(tmp_path, train_pairs, eval_pairs, **overrides):
  for name, pairs in (("train", train_pairs), ("eval", eval_pairs)):
    (tmp_path / f"{name}.tsv").write_text("".join(f"{source}\t{target}\n" for source, target in pairs))
  config = translate_tsv.get_config()
  fields = {**TINY, "data.train_file": str(tmp_path / "train.tsv"), "data.eval_file": str(tmp_path / "eval.tsv"),
            **overrides}
  for key, value in fields.items():
    *parents, leaf = key.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


def _perfect_eval(task, monkeypatch):
  """extra_eval's metrics when every decoded output equals its reference."""
  references = [target for _, target in task.eval_pairs]
  monkeypatch.setattr(task, "translate_ids", lambda model, inputs, max_length: references[:len(inputs)])
  return task.extra_eval(model=None)


def test_auto_scores_space_free_single_word_targets_by_characters():
  choice = bleu.bleu_choice([target for _, target in COMPOUND_WORDS])
  assert (choice.tokenize, choice.defined) == ("char", True)
  assert "fewer than 4 '13a' tokens" in choice.reason


def test_auto_keeps_13a_for_references_that_are_mostly_long_space_separated_text():
  choice = bleu.bleu_choice(SENTENCES + ["yes"])
  assert (choice.tokenize, choice.defined) == ("13a", True)


def test_auto_keeps_char_for_scripts_written_without_spaces():
  for references in (["我们明天早上见面", "今天天气很好"], ["สวัสดีครับ", "ขอบคุณมากครับ"]):
    assert bleu.bleu_choice(references)[:2] == ("char", True)


def test_references_too_short_for_any_4_grams_leave_bleu_undefined():
  for references, setting in (([t for _, t in COMPOUND_WORDS], "13a"), (["ja", "gut", "nie", "sehr"], "auto"),
                              (["你好", "谢谢", "再见"], "auto")):
    choice = bleu.bleu_choice(references, setting)
    assert not choice.defined and "fewer than 4" in choice.reason, (references, setting)


@pytest.mark.parametrize("setting", bleu.BLEU_TOKENIZERS)
def test_bleu_of_exact_single_word_translations_is_100_or_undefined_never_0(tmp_path, monkeypatch, setting):
  task = translate_task.TranslateTask(_config(tmp_path, COMPOUND_WORDS, COMPOUND_WORDS,
                                              **{"task.bleu_tokenize": setting}), str(tmp_path))
  metrics = _perfect_eval(task, monkeypatch)
  assert metrics["exact_match"] == 1.0 and metrics["chrf"] == pytest.approx(100)
  assert metrics.get("bleu", 100.0) == pytest.approx(100)


def test_undefined_bleu_is_left_out_of_the_eval_with_one_log_line_saying_why(tmp_path, monkeypatch, caplog):
  task = translate_task.TranslateTask(_config(tmp_path, COMPOUND_WORDS, COMPOUND_WORDS,
                                              **{"task.bleu_tokenize": "13a"}), str(tmp_path))
  caplog.set_level(logging.INFO)
  caplog.clear()  # the task's choice, logged when it was built
  metrics = _perfect_eval(task, monkeypatch)
  assert set(metrics) == {"exact_match", "chrf"}
  why = [r.getMessage() for r in caplog.records if "eval/bleu" in r.getMessage()]
  assert len(why) == 1 and "undefined" in why[0] and "11 of the 11 references" in why[0], why


def test_the_bleu_tokenizer_and_its_reason_are_logged_once(tmp_path, monkeypatch, caplog):
  caplog.set_level(logging.INFO)
  task = translate_task.TranslateTask(_config(tmp_path, COMPOUND_WORDS, COMPOUND_WORDS), str(tmp_path))
  for _ in range(2):
    assert _perfect_eval(task, monkeypatch)["bleu"] == pytest.approx(100)
  choices = [r.getMessage() for r in caplog.records if "eval/bleu" in r.getMessage()]
  assert len(choices) == 1 and "tokenize='char'" in choices[0] and "word 4-grams" in choices[0], choices


def test_best_metric_bleu_is_accepted_where_auto_defines_it(tmp_path):
  config = _config(tmp_path, COMPOUND_WORDS, COMPOUND_WORDS, **{"checkpoint.best_metric": "eval/bleu"})
  assert translate_task.TranslateTask(config, str(tmp_path))._bleu.defined


def test_best_metric_on_a_bleu_the_corpus_cannot_define_stops_before_training_naming_the_field(tmp_path):
  config = _config(tmp_path, COMPOUND_WORDS, COMPOUND_WORDS,
                   **{"checkpoint.best_metric": "eval/bleu", "task.bleu_tokenize": "13a"})
  workdir = tmp_path / "work"
  with pytest.raises(validation.ConfigError) as error:
    loop.run(config, str(workdir))
  assert error.value.field == "checkpoint.best_metric"
  message = str(error.value)
  assert len(message.splitlines()) == 1 and "eval/bleu is undefined for this corpus" in message
  assert "'eval/exact_match'" in message  # what may be chosen instead
  assert not workdir.exists()  # nothing trained, nothing left behind


def test_launch_stops_a_best_metric_bleu_the_corpus_cannot_define_in_one_line(tmp_path):
  config = _config(tmp_path, COMPOUND_WORDS[4:], COMPOUND_WORDS[:4])
  workdir = tmp_path / "work"
  result = helpers.run(
      [sys.executable, "launch.py", "--config=configs/translate_tsv.py", f"--workdir={workdir}",
       *(f"--config.{key}={value}" for key, value in {**TINY, "data.train_file": config.data.train_file,
                                                        "data.eval_file": config.data.eval_file,
                                                        "checkpoint.best_metric": "eval/bleu",
                                                        "task.bleu_tokenize": "13a"}.items())],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("launch.py: config.checkpoint.best_metric='eval/bleu'"), lines
  assert not workdir.exists()


def test_a_perfect_corpus_scores_bleu_100_not_above():
  """sacrebleu's geometric mean read 100.00000000000004, stored so in metrics.jsonl against README's 0-100."""
  references = ["dimanche 29 novembre 2026", "29 nov. 2026", "jeudi 7 mars 2024"]
  assert bleu.corpus_bleu(references, references, "13a") == 100.0
  assert bleu.corpus_bleu(["dimanche 30 novembre 2026"] + references[1:], references, "13a") < 100.0
