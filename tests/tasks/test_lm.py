"""The causal LM task: a tiny model learns the bundled corpus, infer continues prompts, configs fail early."""
from __future__ import annotations

import collections
import io
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from xattn_jax.data import corpus, lm_algorithmic, text as text_data, tokenizers
from xattn_jax.layers import blocks
from xattn_jax.tasks import lm as lm_task
from xattn_jax.tasks.lm import text as lm_text_task
from xattn_jax.training import errors, loop, validation

# Bytes, a 2-layer d64 model, 120 steps of 16 rows of 64 tokens; 256 eval documents.
TINY = ("--config=configs/lm_text.py:tokenizer=bytes", "--config.model.d_model=64", "--config.model.num_heads=2",
        "--config.model.num_layers=2", "--config.model.mlp_dim=128", "--config.model.max_length=128",
        "--config.data.sequence_length=64", "--config.data.num_eval_documents=256", "--config.batch_size=16",
        "--config.total_steps=120", "--config.eval_every_steps=120", "--config.checkpoint.every_steps=120",
        "--config.log_every_steps=60", "--config.optimizer.learning_rate=3e-3", "--config.optimizer.warmup_steps=20",
        "--config.logging.tensorboard=False", "--config.logging.plot=False", "--config.task.decoding.max_new_tokens=16")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("lm")
  metrics = loop.run(helpers.load_config(*TINY), str(workdir), "train")
  return workdir, metrics


def _unigram_loss(train, evaluation) -> float:
  """Cross-entropy (nats per token) on the eval documents of byte frequencies counted on the training
  documents (EOS counted once per document, add-one smoothing), the pairs the LM is scored on."""
  tokenizer = tokenizers.ByteTokenizer()
  def counts(texts):
    counter = collections.Counter(i for ids in tokenizer.encode_batch(list(texts)) for i in ids)
    counter[tokenizer.eos_id] += len(texts)
    return counter
  train_counts, eval_counts = counts(train), counts(evaluation)
  total = sum(train_counts.values()) + tokenizer.vocab_size
  log_prob = {i: math.log((train_counts[i] + 1) / total) for i in range(tokenizer.vocab_size)}
  return -sum(n * log_prob[i] for i, n in eval_counts.items()) / sum(eval_counts.values())


def test_tiny_lm_eval_loss_is_below_half_the_unigram_loss(trained):
  _, metrics = trained
  bundled = corpus.default_corpus()
  unigram = _unigram_loss(bundled.train, bundled.eval[:256])
  assert metrics["eval/loss"] < 0.5 * unigram
  assert metrics["eval/perplexity"] == math.exp(metrics["eval/loss"])


def test_an_eval_reads_the_eval_rows_once_perplexity_included(trained, monkeypatch):
  """Perplexity was a second pass over every eval row (extra_eval): half of each eval on a large text file.
  It is exp(eval/loss) of the one pass now (Task.derived_eval)."""
  workdir, metrics = trained
  passes, rows = [], text_data.TextBatches.eval_batches
  monkeypatch.setattr(text_data.TextBatches, "eval_batches", lambda *a, **k: passes.append(1) or rows(*a, **k))
  values = loop.run(helpers.load_config(*TINY), str(workdir), "eval")
  assert len(passes) == 1 and values["eval/perplexity"] == math.exp(values["eval/loss"])
  assert values["eval/loss"] == pytest.approx(metrics["eval/loss"], rel=1e-6)


def test_an_eval_may_read_the_run_at_a_longer_context_and_says_so(trained):
  """Train short, test long (ALiBi's evaluation): the RoPE run trained at rows of 64 in a context of 128 is
  scored in rows of 256; the eval's record names the changed fields."""
  import json
  workdir, metrics = trained
  config = helpers.load_config(*TINY, "--config.model.max_length=256", "--config.data.sequence_length=256")
  values = loop.run(config, str(workdir), "eval")
  assert values["eval/loss"] < 0.5 * _unigram_loss(corpus.default_corpus().train, corpus.default_corpus().eval[:256])
  row = json.loads((workdir / "eval_results.jsonl").read_text().splitlines()[-1])
  assert row["changed"]["model.max_length"] == 256 and row["changed"]["data.sequence_length"] == 256


def test_an_eval_logs_samples_that_continue_the_first_half_of_eval_documents(trained, caplog):
  """task.num_samples_logged (3) eval documents, evenly spaced: each cut in half, the model's continuation of the first half (the
  one infer writes for it) beside the second."""
  import ast
  import re
  workdir, _ = trained
  config = helpers.load_config(*TINY)
  with caplog.at_level(logging.INFO):
    loop.run(config, str(workdir), "eval")
  logged = [re.fullmatch(r"sample: (.*) -> (.*) \(the document goes on (.*)\)", record.getMessage())
            for record in caplog.records if record.getMessage().startswith("sample: ")]
  model, task = loop.load_model(str(workdir), "eval")
  assert len(logged) == config.task.num_samples_logged == 3 and all(logged)
  samples = [tuple(map(ast.literal_eval, match.groups())) for match in logged]
  documents = task.sample_documents()
  assert len(documents) == 3 and documents[0] == task.eval_texts[0] and documents[-1] == task.eval_texts[-1]
  for (prompt, _, rest), document in zip(samples, documents):
    assert prompt + rest == document and len(prompt) == len(document.encode()) // 2  # bytes: half the tokens
  assert all(prompt.isascii() for prompt, _, _ in samples)  # so infer reads the same tokens
  assert task.infer(model, [prompt for prompt, _, _ in samples]) == [prompt + added for prompt, added, _ in samples]


@pytest.mark.parametrize("method", ["greedy", "sample", "beam"])
def test_infer_continues_every_prompt_on_one_line(trained, method):
  workdir, _ = trained
  model, task = loop.load_model(str(workdir))
  config = task.config.copy_and_resolve_references()
  config.task.decoding.method = method
  task = lm_task.LanguageModelTask(config, str(workdir), "infer")
  prompts = ["4,213 is four", "dimanche", "The 21st"]
  answers = task.infer(model, prompts)
  assert len(answers) == len(prompts)
  for prompt, answer in zip(prompts, answers):
    assert answer.startswith(prompt) and "\n" not in answer


def test_a_prompt_longer_than_the_context_is_continued_from_its_end_and_written_whole(trained, caplog):
  """model.max_length 128 less BOS and 16 new tokens: a causal LM reads 111 bytes of a prompt. A longer one was
  refused with every other line of the input; it is continued from its last 111 bytes, the line kept whole."""
  workdir, _ = trained
  model, task = loop.load_model(str(workdir))
  long = " ".join(["dimanche 29 novembre 2026"] * 12) + " lundi"  # 317 bytes, a document cut short
  with caplog.at_level(logging.WARNING):
    answers = task.infer(model, ["4,213 is four", long])
  assert answers[0].startswith("4,213 is four")
  assert answers[1].startswith(long) and len(answers[1]) > len(long)
  assert answers[1][len(long):] == task.infer(model, ["?", long[-111:]])[1][111:]  # row 1's key both times
  assert any("line 2, 317 tokens" in record.getMessage() for record in caplog.records)


def test_a_blank_infer_line_is_a_sample_from_nothing(trained, tmp_path):
  """`--mode=infer` with blank lines samples the model unconditionally: each line its own row key, the
  same samples as the task's infer of "" rows."""
  from xattn_jax.training import inference
  workdir, _ = trained
  model, task = loop.load_model(str(workdir))
  (tmp_path / "prompts.txt").write_text("dimanche\n\n\n")
  trainer = type("Trainer", (), {"task": task, "model": lambda self, state: model})()
  answers = inference.infer(trainer, None, str(tmp_path / "prompts.txt"), output=io.StringIO())
  assert answers == task.infer(model, ["dimanche", "", ""])
  assert answers[0].startswith("dimanche") and answers[1] and answers[2] and answers[1] != answers[2], answers


@pytest.mark.parametrize("line, added, expected", [
    ("my", " friend", "my friend"), ("my ", " friend", "my friend"), ("caf", "é", "café"), ("x", "", "x")])
def test_an_infer_line_is_the_prompt_as_given_then_what_the_model_added(line, added, expected):
  assert lm_text_task._continue(line, added) == expected


def test_greedy_continuation_of_a_prompt_does_not_depend_on_the_other_prompts(trained):
  workdir, _ = trained
  model, task = loop.load_model(str(workdir))
  config = task.config.copy_and_resolve_references()
  config.task.decoding.method = "greedy"
  task = lm_task.LanguageModelTask(config, str(workdir), "infer")
  together = task.infer(model, ["12 is twelve", "Allemagne", "1,000,000 is"])
  assert together == [task.infer(model, [prompt])[0] for prompt in ("12 is twelve", "Allemagne", "1,000,000 is")]


@pytest.mark.parametrize("field, value", [("temperature", 0.0), ("top_p", 1.5), ("top_k", -1), ("method", "nucleus"),
                                          ("max_new_tokens", 127)])  # past model.max_length=128 with BOS and a token
def test_a_bad_decoding_option_is_one_config_error_line_naming_it(field, value):
  config = helpers.load_config(*TINY, f"--config.task.decoding.{field}={value}")
  for mode in ("train", "infer"):  # refused before training, not at the first infer line
    with pytest.raises(validation.ConfigError) as error:
      validation.validate_config(config, mode=mode)
    assert error.value.field == f"task.decoding.{field}"
  assert len(str(error.value).splitlines()) == 1


def test_a_sentencepiece_vocab_cap_above_what_a_small_file_supports_still_trains(tmp_path):
  train_file = tmp_path / "small.txt"
  train_file.write_text("".join(f"{n} is {corpus.english_number(n)}.\n" for n in range(200)), encoding="utf-8")
  config = helpers.load_config(*TINY, "--config.data.tokenizer=sentencepiece", "--config.data.vocab_size=4000",
                               f"--config.data.train_file={train_file}", "--config.batch_size=2")
  validation.validate_config(config, mode="train")
  task = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  assert 8 <= task.vocab_size < 4000
  batch = task.train_batch(0, process_index=0, process_count=1)
  assert batch["inputs"].shape == (2, 64) and np.all(batch["inputs"] < task.vocab_size)


def test_a_text_too_small_for_an_exact_vocabulary_names_the_field_that_makes_it_a_cap(tmp_path):
  """The message said '(exact=False)', a tokenizer argument no config field is called."""
  train_file = tmp_path / "small.txt"
  train_file.write_text("the cat sat\nthe dog ran\na bird flew\n", encoding="utf-8")
  config = helpers.load_config(*TINY, "--config.data.tokenizer=sentencepiece", "--config.data.vocab_size=1024",
                               "--config.data.vocab_size_exact=True", f"--config.data.train_file={train_file}")
  with pytest.raises(validation.ConfigError, match=r"at most \d+ pieces.*data\.vocab_size_exact=False") as error:
    lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  assert error.value.field == "data.vocab_size" and len(str(error.value).splitlines()) == 1


def test_bits_per_byte_divide_the_eval_loss_in_bits_by_the_eval_texts_utf8_bytes(trained, tmp_path, caplog):
  """Bytes: bits per byte is eval/loss / ln 2. SentencePiece: the eval text's UTF-8 bytes, EOS one each,
  whatever its pieces (a text's leading word-boundary mark, characters without a piece, said in a warning)."""
  _, metrics = trained
  assert metrics["eval/bits_per_byte"] == pytest.approx(metrics["eval/loss"] / math.log(2), rel=1e-5)
  train_file, eval_file = tmp_path / "small.txt", tmp_path / "eval.txt"
  train_file.write_text("".join(f"{n} is {corpus.english_number(n)}.\n" for n in range(200)), encoding="utf-8")
  eval_texts = ["  7 is seven.", "\u2603 12 is twelve \u20ac", "\u00e9t\u00e9", "4,213 is four thousand two hundred thirteen."]
  eval_file.write_text("".join(f"{t}\n" for t in eval_texts), encoding="utf-8")
  config = helpers.load_config(*TINY, "--config.data.tokenizer=sentencepiece", f"--config.data.train_file={train_file}",
                               f"--config.data.eval_file={eval_file}", "--config.data.sequence_length=16")
  with caplog.at_level(logging.WARNING):
    task = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  assert any("the eval documents hold characters the tokenizer has no piece for: ',aé€☃'" in r.getMessage()
             for r in caplog.records)
  model = task.make_model(nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  [batch] = task.eval_batches(process_index=0, process_count=1)
  values = task.eval_metrics(model, batch)
  assert float(values["bits_per_byte"][1]) == sum(len(t.encode()) + 1 for t in eval_texts) == 86
  assert float(values["bits_per_byte"][0]) == pytest.approx(float(values["loss"][0]) / math.log(2), rel=1e-6)
  assert float(values["loss"][1]) < 86  # fewer tokens than bytes: per-token perplexity is not per-byte


def test_a_file_drawn_from_the_bundled_corpus_training_side_is_told_its_eval_split_is_nearly_empty(tmp_path,
                                                                                                 caplog):
  """600 training lines of the bundled corpus hold out 1 line (the minimum) at the same corpus_seed, not ~30."""
  caplog.set_level(logging.WARNING)
  train_file = tmp_path / "drawn.txt"
  train_file.write_text("".join(f"{line}\n" for line in corpus.default_corpus(seed=0).train[:600]), encoding="utf-8")
  config = helpers.load_config(*TINY, f"--config.data.train_file={train_file}")
  task = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  assert len(task.eval_texts) == 1
  said = [r.getMessage() for r in caplog.records if "held out for eval" in r.getMessage()]
  assert len(said) == 1 and "data.corpus_seed=0" in said[0] and "about 30" in said[0], said
  caplog.clear()
  config.data.corpus_seed = 1
  task = lm_task.LanguageModelTask(config, str(tmp_path / "work1"), "train")
  assert len(task.eval_texts) > 15 and not [r for r in caplog.records if "held out for eval" in r.getMessage()]


def test_a_text_packing_into_fewer_rows_than_a_batch_trains_on_repeated_rows_and_says_so(tmp_path, caplog):
  """A 40-line file once stopped the run ("packs into only N rows; lower batch_size")."""
  caplog.set_level(logging.WARNING)
  train_file = tmp_path / "small.txt"
  train_file.write_text("".join(f"{n} is {corpus.english_number(n)}.\n" for n in range(40)), encoding="utf-8")
  config = helpers.load_config(*TINY, f"--config.data.train_file={train_file}", "--config.batch_size=32")
  task = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  rows = task.train_data.num_rows
  assert rows < 32
  inputs = task.train_batch(0, process_index=0, process_count=1)["inputs"]
  assert inputs.shape == (32, 64) and len({row.tobytes() for row in inputs}) == rows
  assert any(f"packs into {rows} rows of 64, fewer than batch_size=32" in r.getMessage() for r in caplog.records)


def test_a_large_held_out_side_is_scored_on_its_first_max_eval_rows_while_training_and_whole_at_the_end(
    tmp_path, caplog):
  """A 24 MB text file's held-out 5% packed into 6,130 rows took ~14 s an eval; the default scores 2,048 in
  training. --mode=eval, the final score, once read the same first rows; it scores them all."""
  caplog.set_level(logging.INFO)
  train_file = tmp_path / "mine.txt"
  train_file.write_text("".join(f"{n} is {corpus.english_number(n)}.\n" for n in range(2000)), encoding="utf-8")
  config = helpers.load_config(*TINY, f"--config.data.train_file={train_file}", "--config.data.num_eval_documents=0")
  assert config.data.max_eval_rows == 2048  # the config's default
  whole = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train").eval_data
  config.data.max_eval_rows = 5
  capped = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train").eval_data
  assert whole.num_rows > 5 and capped.num_rows == 5
  np.testing.assert_array_equal(capped.packed.inputs, whole.packed.inputs[:5])
  assert any("scores the first 5 of those rows" in r.getMessage() for r in caplog.records)
  final = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "eval").eval_data
  np.testing.assert_array_equal(final.packed.inputs, whole.packed.inputs)
  config.data.max_eval_rows = -1
  with pytest.raises(validation.ConfigError, match=r"data\.max_eval_rows=-1: must be a non-negative integer"):
    validation.validate_config(config, mode="eval")


def test_microbatches_on_a_two_device_mesh_train_as_the_whole_batch(tmp_path):
  """num_microbatches splits each device's rows of the batch (microbatch j: rows j, j + k, ...); the launcher's
  runs with 2 microbatches and without log the same losses, steps 1-4 on a ("data": 2) mesh."""
  losses = []
  for microbatches in (1, 2):
    workdir = tmp_path / f"k{microbatches}"
    overrides = {"mesh.data": 2, "num_microbatches": microbatches, "total_steps": 4, "log_every_steps": 1,
                 "eval_every_steps": 4, "checkpoint.every_steps": 4, "model.dropout_rate": 0.0,
                 "task.num_samples_logged": 0,  # the losses are the point: no sampler to compile,
                 # and RANDOMIZED's small model (less to trace and compile) with 16 eval documents, not 256
                 "model.d_model": 32, "model.num_layers": 1, "model.mlp_dim": 64, "model.max_length": 64,
                 "data.sequence_length": 32, "data.num_eval_documents": 16}
    result = helpers.launch(TINY[0].split("=", 1)[1], workdir, *TINY[1:],  # then these, which win
                            *(f"--config.{key}={value}" for key, value in overrides.items()), device_count=2)
    assert result.returncode == 0, result.stderr[-3000:]
    losses.append([row["train/loss"] for row in helpers.metric_rows(workdir) if "train/loss" in row])
  assert len(losses[0]) == 4
  np.testing.assert_allclose(losses[1], losses[0], rtol=2e-5)


def test_eval_without_an_eval_file_scores_the_documents_training_held_out(tmp_path):
  """--mode=eval once read no training file there: the held-out side was empty ('no eval documents')."""
  train_file = tmp_path / "mine.txt"
  train_file.write_text("".join(f"{n} is {corpus.english_number(n)}.\n" for n in range(400)), encoding="utf-8")
  config = helpers.load_config(*TINY, f"--config.data.train_file={train_file}")
  trained = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  validation.validate_config(config, mode="eval")
  evaluated = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "eval")
  assert evaluated.eval_texts == trained.eval_texts and 0 < len(trained.eval_texts) < 400
  assert not set(evaluated.eval_texts) & set(trained.train_texts)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_eval_file_holding_training_documents_is_said_not_held_out(tmp_path, caplog, mode):
  """The training file named as the eval file scored as held-out text, without a word (the translator warned)."""
  caplog.set_level(logging.WARNING)
  train_file = tmp_path / "mine.txt"
  train_file.write_text("".join(f"{n} is {corpus.english_number(n)}.\n" for n in range(40)), encoding="utf-8")
  (tmp_path / "eval.txt").write_text("3 is three.\nnew text.\n")
  for eval_file, shared in ((train_file, "40 of the 40"), (tmp_path / "eval.txt", "1 of the 2")):
    config = helpers.load_config(*TINY, f"--config.data.train_file={train_file}", f"--config.data.eval_file={eval_file}")
    lm_task.LanguageModelTask(config, str(tmp_path / "work"), mode)
    assert any(f"{shared} eval documents in {eval_file} are also training documents in {train_file}: eval metrics "
               "are not held-out scores" in record.getMessage() for record in caplog.records)


def test_a_long_eval_document_is_scored_by_a_sliding_window_of_half_a_row_by_default(tmp_path):
  """Eval chunks of a long document after its first read data.eval_context tokens of it (weight 0) before the
  ones they score: half of data.sequence_length unless set; 0 scores the training chunks."""
  (tmp_path / "train.txt").write_text("".join(f"{n} is {corpus.english_number(n)}.\n" for n in range(50)))
  (tmp_path / "eval.txt").write_text("x" * 200 + "\n")  # 201 next-token pairs
  rows = {}
  for context in (None, 0, 16):
    extra = [] if context is None else [f"--config.data.eval_context={context}"]
    config = helpers.load_config(*TINY, f"--config.data.train_file={tmp_path / 'train.txt'}",
                                 f"--config.data.eval_file={tmp_path / 'eval.txt'}", *extra)
    packed = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "eval").eval_data.packed
    assert packed.weights.sum() == 201 and packed.inputs.shape[1] == config.data.sequence_length == 64
    rows[context] = packed.num_rows
  assert rows == {None: 1 + 5, 0: 4, 16: 1 + 3}  # 64, then 32 (or 48, or 64) scored a row
  config.data.eval_context = 64
  with pytest.raises(validation.ConfigError, match=r"data\.eval_context=64: must be < data\.sequence_length=64"):
    validation.validate_config(config, mode="eval")
  assert helpers.load_config(*TINY, "--config.data.sequence_length=32").data.eval_context == 16  # follows the row


def test_a_small_file_holds_out_one_document_where_its_fraction_rounds_to_none(tmp_path):
  """5 or 40 lines at eval_fraction 0.05 held out nothing and the run stopped asking for an eval file."""
  train_file = tmp_path / "five.txt"
  train_file.write_text("one\ntwo three\nfour five six\nseven\neight nine ten\n", encoding="utf-8")
  task = lm_task.LanguageModelTask(helpers.load_config(*TINY, f"--config.data.train_file={train_file}"),
                                   str(tmp_path / "work"), "train")
  assert len(task.eval_texts) == 1 and len(task.train_texts) == 4
  assert not set(task.eval_texts) & set(task.train_texts)


def test_a_file_of_one_document_holds_out_its_tail(tmp_path):
  """A single stream (a book on one line, text8) was refused for want of a second line to hold out."""
  words = [corpus.english_number(n) for n in range(600)]
  document = " ".join(words)
  train_file = tmp_path / "stream.txt"
  train_file.write_text(document + "\n", encoding="utf-8")
  config = helpers.load_config(*TINY, f"--config.data.train_file={train_file}")
  trained = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  (head,), (tail,) = trained.train_texts, trained.eval_texts
  assert f"{head} {tail}" == document  # cut at a space
  assert 0.04 < len(tail) / len(document) < 0.06  # data.eval_fraction 0.05
  validation.validate_config(config, mode="eval")
  assert lm_task.LanguageModelTask(config, str(tmp_path / "work"), "eval").eval_texts == (tail,)
  (tmp_path / "word.txt").write_text("a\n", encoding="utf-8")  # one character: nothing to split
  with pytest.raises(validation.ConfigError, match="no eval documents"):
    lm_task.LanguageModelTask(helpers.load_config(*TINY, f"--config.data.train_file={tmp_path / 'word.txt'}"),
                              str(tmp_path / "work2"), "train")


def test_a_file_of_one_line_repeated_is_refused_not_read_as_one_document(tmp_path):
  """100 copies of one line were taken for one document: 99 dropped, one character held out."""
  train_file = tmp_path / "same.txt"
  train_file.write_text("the same line again\n" * 100, encoding="utf-8")
  with pytest.raises(validation.ConfigError, match=r"holds 100 lines, all the same text: none can be held out"):
    lm_task.LanguageModelTask(helpers.load_config(*TINY, f"--config.data.train_file={train_file}"),
                              str(tmp_path / "work"), "train")


def test_an_unreadable_training_line_is_a_config_error_naming_file_and_line(tmp_path):
  train_file = tmp_path / "bad.txt"
  train_file.write_bytes(b"fine\nbad \xff byte\n")
  config = helpers.load_config(*TINY, f"--config.data.train_file={train_file}")
  with pytest.raises(validation.ConfigError, match=f"{train_file}:2"):
    validation.validate_config(config, mode="train")


@pytest.mark.parametrize("operation", lm_algorithmic.OPERATIONS)
def test_algorithmic_rows_are_bos_input_sep_output_eos_weighted_on_the_output_only(operation):
  batch = lm_algorithmic.make_examples(np.random.default_rng(0), 8, operation=operation, min_length=1, max_length=6,
                                       num_symbols=5)
  sep = lm_algorithmic.sep_id(5)
  for inputs, targets, weights, n in zip(batch["inputs"], batch["targets"], batch["weights"], batch["lengths"]):
    symbols = inputs[1:n + 1]
    output = lm_algorithmic.apply(operation, symbols)
    assert inputs[0] == tokenizers.BOS_ID and inputs[n + 1] == sep
    np.testing.assert_array_equal(targets[n:n + 2 + len(output)], [sep, *output, tokenizers.EOS_ID])
    np.testing.assert_array_equal(np.nonzero(weights)[0], np.arange(n + 1, n + 2 + len(output)))


def test_algorithmic_outputs_are_the_operations():
  s = np.array([5, 3, 4, 4])
  assert lm_algorithmic.apply("reverse", s).tolist() == [4, 4, 3, 5]
  assert lm_algorithmic.apply("sort", s).tolist() == [3, 4, 4, 5]
  assert lm_algorithmic.apply("duplicate", s).tolist() == [5, 3, 4, 4, 5, 3, 4, 4]
  assert lm_algorithmic.apply("parity", s).tolist() == [3]  # symbol 4 ('b') occurs twice: even
  assert lm_algorithmic.apply("parity", s[:3]).tolist() == [4]


@pytest.mark.parametrize("arg", ["operation=copy,posenc=rope", "operation=parity,posenc=none,size=tiny",
                                 "operation=duplicate,posenc=t5_bias", "operation=sort,posenc=mrope"])
def test_lm_algorithmic_config_variants_validate(arg):
  validation.validate_config(helpers.load_config(f"--config=configs/lm_algorithmic.py:{arg}"), mode="train")


@pytest.mark.parametrize("arg", ["posenc=mrope", "posenc=alibi,tokenizer=bytes,size=small", "posenc=learned,size=micro"])
def test_lm_text_config_variants_validate(arg):
  validation.validate_config(helpers.load_config(f"--config=configs/lm_text.py:{arg}"), mode="train")


@pytest.mark.parametrize("max_length", [8, 1000])
def test_lm_algorithmic_max_length_it_would_ignore_is_a_config_error(max_length):
  """The task builds its model with the positions of its longest row (task.eval_bands): model.max_length=8 or 1000
  trained the same 163-position model without a word. That value, or one the config writes, passes (other eval bands
  or --config.task.operation keep the config's value valid); eval and infer read a recorded run's as it is."""
  config = helpers.load_config("--config=configs/lm_algorithmic.py", f"--config.model.max_length={max_length}")
  with pytest.raises(validation.ConfigError, match=rf"^config.model.max_length={max_length}: lm_algorithmic builds "
                                                   r"its model with the positions of its longest row, 163 \("):
    validation.validate_config(config, mode="train")
  validation.validate_config(config, mode="eval")
  for fields in ([], ["--config.task.eval_bands=1-20,21-40"], ["--config.task.eval_bands=1-20,21-40",
                                                                "--config.model.max_length=83"],
                 ["--config.task.operation=duplicate"]):  # the config wrote copy's 163: duplicate's rows need 243
    validation.validate_config(helpers.load_config("--config=configs/lm_algorithmic.py", *fields), mode="train")


def test_kv_heads_that_do_not_divide_the_heads_are_a_config_error():
  config = helpers.load_config(*TINY, "--config.model.num_kv_heads=3")
  with pytest.raises(validation.ConfigError, match="model.num_kv_heads"):
    validation.validate_config(config, mode="train")


def test_lm_algorithmic_run_logs_exact_match_per_band_and_infer_answers_each_line(tmp_path):
  config = helpers.load_config(
      "--config=configs/lm_algorithmic.py:size=micro,operation=reverse,posenc=alibi", "--config.total_steps=8",
      "--config.eval_every_steps=8", "--config.checkpoint.every_steps=8", "--config.logging.tensorboard=False",
      "--config.logging.plot=False", "--config.task.num_eval_examples=8", "--config.task.eval_bands=1-4,5-8",
      "--config.task.train_max_length=4", "--config.batch_size=8", "--config.eval_batch_size=8")
  metrics = loop.run(config, str(tmp_path), "train")
  assert {"eval/exact_match_1_4", "eval/exact_match_5_8", "eval/token_accuracy_1_4"} <= set(metrics)
  model, task = loop.load_model(str(tmp_path))
  answers = task.infer(model, ["abc", "dcbad"])
  assert len(answers) == 2 and all(answers)
  # ALiBi reads any position: an eval may ask for bands past the trained ones
  config.task.eval_bands = "1-4,9-16"
  assert {"eval/exact_match_9_16"} <= set(loop.run(config, str(tmp_path), "eval"))


@pytest.mark.parametrize("config_file, needed", [("lm_algorithmic.py", (83, 323)), ("algorithmic.py", (41, 161))])
@pytest.mark.parametrize("posenc", ["learned", "rope"])
def test_algorithmic_eval_bands_keep_a_learned_table_as_trained(tmp_path, posenc, config_file, needed):
  """The model's positions follow task.eval_bands, which eval may change: a learned run's table was trained
  with the rows its own bands needed, so a narrower eval failed to restore it ([163, d] in the checkpoint, [83, d]
  built) and a wider one asked for rows it lacks. Eval and infer now build the trained table and refuse bands
  beyond it, naming the field; other encodings follow the bands. The decoder-only and the encoder-decoder task
  alike."""
  from xattn_jax.tasks import algorithmic as seq2seq_task
  from xattn_jax.tasks.lm import algorithmic as lm_algorithmic_task
  from xattn_jax.training import workdir as workdir_lib
  task_class = lm_algorithmic_task.LMAlgorithmicTask if config_file == "lm_algorithmic.py" else seq2seq_task.AlgorithmicTask
  size = "micro" if config_file == "lm_algorithmic.py" else "tiny"
  trained = helpers.load_config(f"--config=configs/{config_file}:size={size},posenc={posenc}")
  workdir_lib.write_config(trained, str(tmp_path))
  rows = task_class.positions_needed(trained)
  for bands, positions in zip(("1-20,21-40", "1-20,81-160"), needed):
    config = helpers.load_config(f"--config=configs/{config_file}:size={size},posenc={posenc}",
                                 f"--config.task.eval_bands={bands}")
    for mode in ("eval", "infer"):
      if posenc == "learned" and positions > rows:
        with pytest.raises(validation.ConfigError, match=rf"^config\.task\.eval_bands='{bands}': need {positions} "
                                                          rf"positions; the run's learned position table has {rows}"):
          task_class(config, str(tmp_path), mode)
      else:
        assert task_class(config, str(tmp_path), mode).max_length == (rows if posenc == "learned" else positions)


@pytest.mark.parametrize("field, registry", [("norm_type", blocks.NORM_TYPES), ("mlp_type", blocks.MLP_TYPES),
                                             ("activation", blocks.ACTIVATIONS)])
def test_the_norm_and_mlp_choices_a_config_may_name_are_the_registries(field, registry):
  config = helpers.load_config(*TINY, f"--config.model.{field}=unregistered")
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(config, mode="train")
  assert str(error.value) == f"config.model.{field}='unregistered': allowed are {sorted(registry)}"


# Bytes, one d32 layer, rows of 32 tokens, 24 steps: randomized positions from [0, 256).
RANDOMIZED = (*TINY, "--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.mlp_dim=64",
              "--config.model.max_length=64", "--config.data.sequence_length=32", "--config.data.num_eval_documents=16",
              "--config.batch_size=8", "--config.total_steps=24", "--config.eval_every_steps=24",
              "--config.checkpoint.every_steps=24", "--config.log_every_steps=8", "--config.optimizer.warmup_steps=4",
              "--config.optimizer.learning_rate=1e-2",
              "--config.model.randomized_positions_max=256")


def test_a_language_model_with_randomized_positions_trains(tmp_path):
  config = helpers.load_config(*RANDOMIZED)
  validation.validate_config(config, mode="train")
  loop.run(config, str(tmp_path), "train")
  losses = [row["train/loss"] for row in helpers.metric_rows(tmp_path) if "train/loss" in row]
  assert len(losses) == 3 and losses[-1] < 0.8 * losses[0]


def test_the_training_loss_draws_randomized_positions_from_the_step_rngs(tmp_path):
  config = helpers.load_config(*RANDOMIZED)
  task = lm_task.LanguageModelTask(config, str(tmp_path), "train")
  model = task.make_model(nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in task.train_batch(0, process_index=0, process_count=1).items()}
  loss = nnx.jit(lambda model, batch, key: task.loss(model, batch, rngs=nnx.Rngs(key))[0])
  losses = [float(loss(model, batch, jax.random.key(seed))) for seed in (0, 0, 1)]
  assert losses[0] == losses[1] != losses[2]


@pytest.mark.parametrize("overrides, field", [
    (("--config.model.randomized_positions_max=-1",), "model.randomized_positions_max"),
    (("--config.model.randomized_positions_max=100",), "model.randomized_positions_max"),  # < max_length 128
    (("--config.model.position_encoding=mrope", "--config.model.randomized_positions_max=256"),
     "model.randomized_positions_max"),
])
def test_a_bad_randomized_positions_field_is_a_config_error_naming_it(overrides, field):
  config = helpers.load_config(*TINY, *overrides)
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(config, mode="train")
  assert error.value.field == field


def test_lm_algorithmic_randomized_positions_must_cover_the_longest_eval_row():
  config = helpers.load_config("--config=configs/lm_algorithmic.py:size=micro", "--config.task.eval_bands=1-20,21-90",
                               "--config.model.randomized_positions_max=170")
  with pytest.raises(validation.ConfigError, match=r"model\.randomized_positions_max=170: must be >= 183"):
    validation.validate_config(config, mode="train")


def test_the_vlm_lm_trains_on_the_vlm_texts_and_keeps_the_image_token_one_piece(tmp_path):
  from xattn_jax.data import vlm_digits
  config = helpers.load_config("--config=configs/vlm_lm.py", "--config.data.num_train_documents=300",
                               "--config.data.num_eval_documents=40", "--config.batch_size=4")
  validation.validate_config(config, mode="train")
  task = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  assert task.train_texts[::2] == tuple(vlm_digits.texts(vlm_digits.make_examples("train", 150, seed=0)))
  # its eval side is validation's texts: the LM never reads a test text
  assert task.eval_texts[::2] == tuple(vlm_digits.texts(vlm_digits.make_examples("validation", 20, seed=0)))
  assert task.train_texts[1::2] == tuple(map(vlm_digits.described_text_of,
                                             vlm_digits.make_examples("train", 150, seed=0)))
  tokenizer = task.tokenizer
  [image_id] = tokenizer.encode(vlm_digits.IMAGE_TOKEN)
  for example in vlm_digits.make_examples("test", 40, seed=0):
    pieces = [[image_id] if role == "image" else tokenizer.encode(value) for role, value in example.segments]
    assert tokenizer.encode(vlm_digits.text_of(example)) == [i for ids in pieces for i in ids]


def test_the_vlm_lm_trains_each_text_its_own_default_steps_unless_the_config_names_them():
  from configs import vlm_lm
  for text, steps in vlm_lm.DEFAULT_STEPS.items():
    assert helpers.load_config(f"--config=configs/vlm_lm.py:text={text}").total_steps == steps
  assert set(vlm_lm.DEFAULT_STEPS) == set(vlm_lm.TEXTS)
  assert helpers.load_config("--config=configs/vlm_lm.py:steps=600").total_steps == 600


def test_the_vlm_lm_keeps_no_best_checkpoint_by_its_eval_loss():
  """Its eval/loss is lowest near step 600 while its answers from words improve to the end: a checkpoint kept
  as "best" by it (the default best_metric) was the wrong LM for checkpoint.eval_from=best."""
  assert helpers.load_config("--config=configs/vlm_lm.py").checkpoint.best_metric == ""
  assert helpers.load_config("--config=configs/lm_text.py").checkpoint.best_metric == "eval/loss"


def test_the_vlm_lm_takes_a_depth_other_than_its_sizes():
  from configs import lm_text
  assert helpers.load_config("--config=configs/vlm_lm.py").model.num_layers == lm_text.SIZES["tiny"][2]
  deeper = helpers.load_config("--config=configs/vlm_lm.py:layers=4,steps=4000")
  assert (deeper.model.num_layers, deeper.total_steps, deeper.model.d_model) == (4, 4000, lm_text.SIZES["tiny"][0])


def test_the_lm_of_a_users_pairs_learns_the_text_after_each_image_marker(tmp_path):
  """configs/vlm_tsv.py pretrains its frozen LM this way: the digits' LM could not write a user's words."""
  pairs = tmp_path / "pairs.tsv"
  pairs.write_text("".join(f"img{n}.png\ta {shape} drawn in black\n" for n, shape in
                           enumerate(["circle", "square", "cross"] * 10)))
  config = helpers.load_config("--config=configs/vlm_lm.py:text=pairs", f"--config.data.train_file={pairs}",
                               f"--config.data.eval_file={pairs}")
  validation.validate_config(config, mode="train")
  task = lm_task.LanguageModelTask(config, str(tmp_path / "work"), "train")
  assert task.train_texts[:2] == ("<image> a circle drawn in black", "<image> a square drawn in black")
  assert task.tokenizer.encode("<image>") == [task.tokenizer.encode("<image> a")[0]]  # one marker piece
  for caption in ("a cross drawn in black", "a circle"):
    assert task.tokenizer.decode(task.tokenizer.encode(caption)) == caption
  for argument, field in (("--config.data.file_format=csv", "data.file_format"),
                          ("--config.data.train_file=", "data.train_file")):  # the pairs format reads a file
    bad = helpers.load_config("--config=configs/vlm_lm.py:text=pairs", f"--config.data.train_file={pairs}", argument)
    with pytest.raises(validation.ConfigError) as error:
      validation.validate_config(bad, mode="train")
    assert error.value.field == field


def test_a_generated_corpus_with_a_training_file_is_a_config_error(tmp_path):
  config = helpers.load_config("--config=configs/vlm_lm.py", f"--config.data.train_file={tmp_path}/x.txt")
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(config, mode="train")
  assert error.value.field == "data.source"


def test_infer_never_continues_with_a_suppressed_id_even_where_the_model_ranks_it_first(tmp_path):
  """The output layer ranks padding, BOS and the bytes of line breaks (never_generated_ids) above every other
  id, 'x' next: infer (the config's decoding method) continues each prompt with 'x' alone."""
  config = helpers.load_config(*TINY, "--config.model.tie_output=False")
  task = lm_task.LanguageModelTask(config, str(tmp_path), "infer")
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  never = list(task.tokenizer.never_generated_ids)
  assert len(never) >= 4  # padding, BOS, "\n", "\r"
  preference = np.zeros(task.vocab_size, np.float32)  # the logits of every position, whatever it reads
  preference[never], preference[task.tokenizer.encode("x")] = 60.0, 30.0
  model.output.kernel[...] = jnp.zeros_like(model.output.kernel[...])
  model.output.bias[...] = jnp.asarray(preference)
  new = config.task.decoding.max_new_tokens
  assert task.infer(model, ["dimanche", ""]) == ["dimanche" + "x" * new, "x" * new]


def test_a_prompt_cropped_to_the_context_fits_a_learned_position_table(tmp_path):
  """model.max_length 128 less BOS and 5 new tokens: a prompt of 122 bytes (123 with BOS) was padded to 128 for
  the compiled shapes, a cache of 132 positions that the table of 128 rows refused."""
  config = helpers.load_config(*TINY, "--config.model.position_encoding=learned",
                               "--config.task.decoding.max_new_tokens=5", "--config.task.decoding.method=greedy")
  task = lm_task.LanguageModelTask(config, str(tmp_path), "infer")
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  long = "dimanche 29 novembre 2026 " * 8
  assert task.infer(model, [long])[0].startswith(long)


def test_infer_decodes_its_lines_in_batches_of_eval_batch_size_with_the_answers_of_one_batch(tmp_path):
  """Every line was a row of one decode: a file of thousands of prompts held every row's cache at once."""
  config = helpers.load_config(*TINY, "--config.eval_batch_size=2", "--config.task.decoding.max_new_tokens=4")
  task = lm_task.LanguageModelTask(config, str(tmp_path), "infer")
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  generate, rows = task._generate, []

  def counting(model, tokens, *args, **kwargs):
    rows.append(len(tokens))
    return generate(model, tokens, *args, **kwargs)

  task._generate = counting
  lines = ["dimanche", "4,213 is", "", "The 21st", "lundi"]
  answers = task.infer(model, lines)
  assert rows == [2, 2, 2]
  one_batch = helpers.load_config(*TINY, "--config.task.decoding.max_new_tokens=4")  # eval_batch_size 64
  assert answers == lm_task.LanguageModelTask(one_batch, str(tmp_path), "infer").infer(model, lines)


def test_a_run_stopped_before_its_first_checkpoint_starts_again_on_another_file(tmp_path):
  """Ctrl-C while the first call compiled, then the command again with the right file (or vocab_size): the
  SentencePiece model the stopped attempt trained was refused as trained on other text (or with more pieces than the
  cap), though no model had read it."""
  wrong, right = tmp_path / "wrong.txt", tmp_path / "right.txt"
  wrong.write_text("the wrong file\nwith its own lines\nthree of them\n")
  right.write_text("zebra quagga\nokapi giraffe\nhippo rhino\n")
  config = helpers.load_config("--config=configs/lm_text.py:size=micro", f"--config.data.train_file={wrong}")
  lm_task.LanguageModelTask(config, str(tmp_path / "run"), "train")
  config.data.train_file = str(right)
  task = lm_task.LanguageModelTask(config, str(tmp_path / "run"), "train")
  assert [task.tokenizer.decode(task.tokenizer.encode(text)) for text in task.train_texts] == list(task.train_texts)
  config.data.vocab_size = 24  # below the pieces it has: its cap was another
  assert lm_task.LanguageModelTask(config, str(tmp_path / "run"), "train").vocab_size <= 24
  (tmp_path / "run" / "checkpoints" / "8").mkdir(parents=True)  # a model has read it now: it stays, and a
  model_file = tmp_path / "run" / lm_text_task.SPM_FILE           # resumed run encodes an edited file with it (it
  kept = model_file.read_bytes()                                  # was refused after the loop's "training on over
  config.data.train_file = str(wrong)                             # data files edited" warning)
  task = lm_task.LanguageModelTask(config, str(tmp_path / "run"), "train")
  assert model_file.read_bytes() == kept and task.vocab_size <= 24


def test_the_batches_of_a_task_built_for_infer_are_refused_naming_the_mode_that_reads_them(tmp_path):
  """Built for infer (`loop.load_model`'s default) the task holds no data: its batches were an AttributeError."""
  task = lm_task.LanguageModelTask(helpers.load_config(*TINY), str(tmp_path), "infer")
  with pytest.raises(errors.RunError, match=r"eval_batches: needs the task built in mode 'train' or 'eval', got mode="):
    task.eval_batches(process_index=0, process_count=1)
  with pytest.raises(errors.RunError, match=r"train_batch: needs the task built in mode 'train', got mode='infer'"):
    task.train_batch(0, process_index=0, process_count=1)
