"""Translation task: the encoder-decoder Translator on CLDR date pairs or a user's TSV corpus.

Config (see configs/translate_dates.py and configs/translate_tsv.py):
  data.source          "dates" (bundled: English -> data.target_locale, split by date into train, data.eval_fraction
                       for validation and data.test_fraction for test; data.eval_split picks the side eval reads:
                       validation while training, test for the final score with --mode=eval) or "tsv"
                       (data.train_file / data.eval_file of UTF-8 "source<TAB>target" lines; without an
                       eval file, data.eval_fraction of the training file's sources are held out, every
                       pair of a held-out source with them, by a stable hash of the source and data.split_seed)
  data.tokenizer       "sentencepiece" (trained on both sides of the training text into
                       <workdir>/tokenizer/, reused on resume and in eval / infer) or "bytes"
  model.*              Translator sizes and options; model.position_encoding one of
                       translator.position_encodings(), norm / activation from layers.blocks;
                       model.randomized_positions_max / _at_eval: randomized positions (0 = off; drawn
                       from the step's rngs in training, unpacked rows only)
  task.decoding.*      how eval and infer decode: method greedy | beam | sample and its options
                       (tasks.decoding_config lists them)
  task.*               label smoothing, how many eval sentences to decode, log and plot

Metrics, logged as eval/<name> at every eval ("decoded pairs": while training, task.num_decode_examples of
the eval pairs, evenly spaced through them, the same at every eval, 0 = all of them; --mode=eval decodes every
pair; decoded by the model alone as task.decoding says, greedy by default):
  eval/loss         cross-entropy per target token (EOS included, no label smoothing), teacher-forced,
                    over every eval pair
  eval/accuracy     share of those target tokens whose most likely id is the reference's, teacher-forced,
                    over every eval pair
  eval/exact_match  share of the decoded pairs whose output string equals the reference
  eval/bleu         sacrebleu corpus BLEU (0-100: brevity penalty x geometric mean of the 1- to 4-gram
                    precisions) of the decoded pairs, tokenized by task.bleu_tokenize. "auto" (see
                    bleu.bleu_choice) reads the references: "char" for scripts written without spaces
                    (Chinese, Japanese, Thai, ...) and where most references have under four "13a"
                    tokens (compound words, one-word answers: "13a" leaves them no word 4-grams, so BLEU
                    would be 0 even for exact translations), "13a" otherwise. Where most references
                    have under four tokens of the tokenizer chosen, BLEU is undefined for the corpus: it
                    is left out of every eval (one log line says why), never written as 0, and
                    checkpoint.best_metric=eval/bleu stops the run before training
  eval/chrf         sacrebleu corpus chrF (0-100: F-score of character 1- to 6-grams, recall weighted by
                    beta 2) of the decoded pairs; defined on any corpus
Each eval also logs a few sample translations and writes cross-attention maps (target tokens by source
tokens, per decoder layer) of its first task.num_attention_plots decoded pairs to plots/cross_attention_<k>.png under
Task.figure_directory (the workdir while training), removing those an earlier eval drew beyond that count;
--mode=eval draws them to eval_results/step_N/plots/cross_attention_<evaluated>_<k>.png in it, named for what it read
(`TranslateTask.evaluated_name`: data.eval_split, or the data.eval_file), so evals of one step on other sides or
files keep each other's.
"""
from __future__ import annotations

import filecmp
import functools
import hashlib
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from xattn_jax import decoding
from xattn_jax.data import batching, dates, splits, tokenizers, tsv
from xattn_jax.layers import blocks
from xattn_jax.models import translator as translator_lib
from xattn_jax.tasks import decoding_config, reading_fields
from xattn_jax.tasks.translate import bleu
from xattn_jax.tasks.translate import plots as translate_plots
from xattn_jax.training import checkpoints, optim, sharding, task as task_lib, validation

DATA_SOURCES = ("dates", "tsv")
TOKENIZERS = ("sentencepiece", "bytes")
SPM_FILE = os.path.join("tokenizer", "sentencepiece.model")
# Packed batches' keys -> the translator's keyword arguments.
_PACKING_KEYS = {"inputs_segmentation": "inputs_segmentation", "inputs_position": "inputs_positions",
                 "targets_segmentation": "targets_segmentation", "targets_position": "targets_positions"}


def _read_tsv(field: str, path: str):
  """The pairs of a TSV corpus, or a ConfigError naming the field, the file and the bad line.

  The config check reads the corpus before anything is built and the task reads it again: the
  second read of an unchanged file (same size and modification time) reuses the first's pairs.
  """
  validation.require_file(field, path)
  stat = os.stat(path)
  try:
    return _parse_tsv(path, stat.st_size, stat.st_mtime_ns)
  except tsv.CorpusFormatError as error:
    raise validation.ConfigError(field, path, " ".join(str(error).split())) from None


@functools.lru_cache(maxsize=2)  # a run's training and eval files
def _parse_tsv(path: str, size: int, mtime_ns: int) -> tuple:
  del size, mtime_ns  # part of the cache key only
  return tuple(tsv.read_parallel_tsv(path))


def _upward(path: str, levels: int):
  """path and its parents, `levels` directories in all."""
  path = os.path.abspath(path)
  for _ in range(levels):
    yield path
    path = os.path.dirname(path)


def stack_sizes(model_config) -> tuple[translator_lib.StackSize, translator_lib.StackSize]:
  return tuple(translator_lib.StackSize(side.d_model, side.num_heads, side.num_layers, side.mlp_dim)
               for side in (model_config.encoder, model_config.decoder))


@task_lib.register("translate")
class TranslateTask(task_lib.Task):
  """English -> target-locale dates, or any parallel corpus (see the module docstring)."""
  eval_metric_names = ("eval/loss", "eval/accuracy", "eval/exact_match", "eval/bleu", "eval/chrf")
  position_encodings = staticmethod(translator_lib.position_encodings)
  held_out_fields = ("data.eval_fraction", "data.test_fraction", "data.split_seed")

  @classmethod
  def validate(cls, config, mode="train"):
    data, model, task = config.data, config.model, config.task
    validation.require_choice(config, "model.name", ("translator",))
    validation.require_choice(config, "model.norm", blocks.NORM_PLACEMENTS)
    validation.require_choice(config, "model.activation", blocks.ACTIVATIONS)
    # validation.check_attention_dims has already checked each side's head_dim for rope.
    for side in ("encoder", "decoder"):
      validation.require_positive(config, *(f"model.{side}.{f}" for f in ("d_model", "num_heads", "num_layers",
                                                                          "mlp_dim")))
    if model.share_embeddings and model.encoder.d_model != model.decoder.d_model:
      raise validation.ConfigError("model.share_embeddings", True,
                                   "needs model.encoder.d_model == model.decoder.d_model")
    validation.require_positive(config, "model.max_length")
    validation.require_positive(config, "task.max_decode_length", "task.num_decode_examples",
                                "task.num_samples_logged", "task.num_attention_plots",
                                "data.max_source_length", "data.max_target_length", allow_zero=True)
    for old, new in (("beam_size", "beam_size"), ("length_penalty", "alpha")):
      if old in task:  # a config written before task.decoding existed
        raise validation.ConfigError(f"task.{old}", task[old], f"moved to task.decoding.{new} (with "
                                     "task.decoding.method='beam'); write the task.decoding section instead")
    decoding_config.decoding_options(config)
    # model.randomized_positions_max itself is checked with the position encoding (check_attention_dims).
    if "randomized_positions_at_eval" in model:
      validation.require_choice(config, "model.randomized_positions_at_eval", (True, False))
    if model.get("randomized_positions_max", 0) and data.packing:
      raise validation.ConfigError("model.randomized_positions_max", model.randomized_positions_max,
                                   "packed rows keep their positions as given, so nothing would be randomized: "
                                   "set data.packing=False, or 0 = off")
    if "bleu_tokenize" in task:
      validation.require_choice(config, "task.bleu_tokenize", bleu.BLEU_TOKENIZERS)
    validation.require_choice(config, "data.source", DATA_SOURCES)
    validation.require_choice(config, "data.tokenizer", TOKENIZERS)
    if data.tokenizer == "sentencepiece":  # else 0 or -1 reaches sentencepiece only after the corpus is built
      validation.require_positive(config, "data.vocab_size")
    if data.source == "dates":  # a file named here would be ignored without a word
      for field in ("train_file", "eval_file"):
        if data.get(field):
          raise validation.ConfigError(f"data.{field}", data[field], "the generated dates (data.source='dates') "
                                       "read no file: set data.source='tsv' (configs/translate_tsv.py), or '' here")
    if "vocab_size_exact" in data:  # absent from configs written before it existed: False
      validation.require_choice(config, "data.vocab_size_exact", (True, False))
    if data.length_bucketing and data.packing:
      raise validation.ConfigError("data.packing", True, "choose data.packing or data.length_bucketing, not both")
    for field, value in (("data.max_source_length", data.max_source_length),
                         ("data.max_target_length", data.max_target_length),
                         ("task.max_decode_length", task.max_decode_length)):
      if value > model.max_length:
        raise validation.ConfigError(field, value, f"must be <= model.max_length={model.max_length}")
    if data.source == "dates":
      try:
        dates.parse_locale(data.target_locale)
      except ValueError as error:
        raise validation.ConfigError("data.target_locale", data.target_locale, str(error)) from None
      formats = [f.strip() for f in validation.require_string("data.formats", data.formats, "long,medium").split(",")]
      if not formats or any(f not in dates.DATE_FORMATS for f in formats) or len(set(formats)) != len(formats):
        raise validation.ConfigError("data.formats", data.formats,
                                     f"comma-separated distinct names from {list(dates.DATE_FORMATS)}")
      for field in ("data.first_year", "data.last_year"):
        year = data[field.split(".")[1]]
        if not isinstance(year, int) or not 1 <= year <= 9999:
          raise validation.ConfigError(field, year, "must be an integer year in 1..9999")
      if data.first_year > data.last_year:
        raise validation.ConfigError("data.first_year", data.first_year, f"must be <= data.last_year={data.last_year}")
    if (data.source == "dates" or not data.eval_file) and not (
        validation.is_number(data.eval_fraction) and 0 < data.eval_fraction < 1):
      raise validation.ConfigError("data.eval_fraction", data.eval_fraction, "must be in (0, 1): the share of the "
                                   "dates, or of data.train_file's sources without a data.eval_file, held out for eval")
    eval_split = data.get("eval_split", "validation")  # absent from configs written before it existed
    if "eval_split" in data:
      validation.require_choice(config, "data.eval_split", splits.EVAL_SPLITS)
    if data.source == "dates":
      test_fraction = data.get("test_fraction", 0.0)  # absent from configs written before it existed
      if "test_fraction" in data:
        validation.require_non_negative_number(
            config, "data.test_fraction", f"must be in [0, 1 - data.eval_fraction) = [0, {1 - data.eval_fraction:g}): "
            "the share of the dates held out for the final score", below=1 - data.eval_fraction)
      if eval_split == "test" and not test_fraction:
        raise validation.ConfigError("data.eval_split", eval_split, "reads the test dates, and data.test_fraction "
                                     "is 0: raise it, or evaluate on 'validation'")
    elif eval_split == "test":
      raise validation.ConfigError("data.eval_split", eval_split, "holds out test dates of the bundled data only; a "
                                   "TSV run's test score is --mode=eval --config.data.eval_file=YOUR_TEST.tsv")
    if data.source != "dates" and mode != "infer":  # inference reads only the workdir's tokenizer, not the corpus
      # Reads the files now, so a malformed line stops the run before anything is built; eval
      # needs only the eval file (the tokenizer is the run's), or the training file it holds out of.
      if mode == "train" or not data.eval_file:
        _read_tsv("data.train_file", data.train_file)
      if data.eval_file:
        _read_tsv("data.eval_file", data.eval_file)

  @classmethod
  def eval_model_fields(cls, config):
    """Eval and infer may read a run at a longer model.max_length (but where it sizes a learned table), RoPE
    rescaled or with another attention implementation (tasks.reading_fields): longer sentences than it trained on."""
    return reading_fields.position_reading_fields(config)

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    # Only training reads the training corpus and trains the tokenizer; eval and infer use the
    # run's tokenizer, and infer reads no corpus at all (its files may be gone).
    self.train_pairs, self.eval_pairs = self._pairs() if mode != "infer" else ([], [])
    if mode != "infer":  # before the tokenizer is trained: a best_metric BLEU cannot define stops here
      self._bleu = self._choose_bleu()
    self.tokenizer = self._tokenizer() if mode == "train" else self._saved_tokenizer()
    if mode != "infer":
      self._check_eval_lengths()
      self.tokenizer.warn_unknown_characters((text for pair in self.eval_pairs for text in pair), "the eval pairs",
                                             ": a reference holding them cannot be written")
    if mode == "train":
      self._note_small_corpus()
      self._note_padding()
    if mode != "infer":
      self._log_bleu_choice()
      if len(self._decoded_indices) < len(self.eval_pairs):
        logging.info("Each eval decodes %d of the %d eval pairs, evenly spaced (task.num_decode_examples; 0 = all); "
                     "eval/loss and eval/accuracy read them all", len(self._decoded_indices), len(self.eval_pairs))
    self.vocab_size = self.tokenizer.vocab_size
    self.options = decoding_config.decoding_options(config)
    decoding_config.note_top_k(config, self.vocab_size)
    self._generate = nnx.jit(decoding.generate,
                             static_argnames=("max_length", "bos_id", "eos_id", "options", "suppress_ids",
                                              "logits_sharding"))
    self._attention = nnx.jit(lambda model, inputs, decoder_inputs: model.cross_attention_weights(
        inputs, decoder_inputs))

  # --- data -------------------------------------------------------------------------------------

  def _pairs(self):
    data = self.config.data
    if data.source == "dates":
      pairs = dates.date_pairs(data.target_locale, formats=tuple(f.strip() for f in data.formats.split(",")),
                               first_year=data.first_year, last_year=data.last_year,
                               eval_fraction=data.eval_fraction, seed=data.split_seed,
                               test_fraction=data.get("test_fraction", 0.0))
      return pairs.train, pairs.test if data.get("eval_split", "validation") == "test" else pairs.eval
    if not data.eval_file:  # held out of the training file: every pair of a source on one side
      rows = list(enumerate(_read_tsv("data.train_file", data.train_file), 1))
      train_rows, eval_rows = splits.split_by_key(rows, lambda row: row[1][0], seed=data.split_seed,
                                                  eval_fraction=data.eval_fraction, min_eval_keys=1)
      if not eval_rows:
        raise validation.ConfigError("data.eval_file", "", f"no eval pairs: {data.train_file} has one distinct source, "
                                     "which training needs; name an eval file, or give pairs of two sources at least "
                                     "(one is held out)")
      self._eval_lines = (data.train_file, [line for line, _ in eval_rows])
      self._train_lines = (data.train_file, [line for line, _ in train_rows])
      logging.info("No data.eval_file: %d of the %d pairs of %s (data.eval_fraction=%g of the sources, by a stable "
                   "hash) are held out for eval", len(eval_rows), len(rows), data.train_file, data.eval_fraction)
      return [pair for _, pair in train_rows] if self.mode == "train" else [], [pair for _, pair in eval_rows]
    train = _read_tsv("data.train_file", data.train_file) if self.mode == "train" else []
    evaluation = _read_tsv("data.eval_file", data.eval_file)
    self._eval_lines = (data.eval_file, range(1, len(evaluation) + 1))
    self._train_lines = (data.train_file, range(1, len(train) + 1))
    # an eval reads the training file where it is still there, to say so too
    trained_on = train or (_read_tsv("data.train_file", data.train_file) if os.path.isfile(data.train_file) else [])
    splits.warn_shared([source for source, _ in evaluation], [source for source, _ in trained_on], data.eval_file,
                       data.train_file, "sources")
    return train, evaluation

  def _tokenizer(self) -> tokenizers.Tokenizer:
    data = self.config.data
    if data.tokenizer == "bytes":
      return tokenizers.ByteTokenizer()
    if not self.workdir:
      raise ValueError("TranslateTask: data.tokenizer='sentencepiece' needs a workdir to keep the model in")
    path = os.path.join(self.workdir, SPM_FILE)
    if jax.process_index() == 0:  # trains it, or reuses the file a previous run of this workdir wrote
      reused = os.path.exists(path)
      inherited = self._take_init_from_tokenizer(path)
      texts = [text for pair in self.train_pairs for text in pair]
      saved = bool(checkpoints.step_numbers(self.workdir))  # a resumed run keeps the model its checkpoints read,
      try:                                                  # whatever an edited file now holds (the loop warns)
        tokenizer = tokenizers.train_sentencepiece(texts, path, vocab_size=data.vocab_size,
                                                   exact=data.get("vocab_size_exact", False),
                                                   texts_must_match=self.mode == "train" and not inherited
                                                   and not saved)
      except tokenizers.OtherTextsError as error:
        raise validation.ConfigError("data.train_file", data.train_file, str(error)) from None
      except ValueError as error:  # e.g. a corpus too small for an exact vocabulary
        message = " ".join(str(error).split()).replace("exact=False", "data.vocab_size_exact=False")
        raise validation.ConfigError("data.vocab_size", data.vocab_size,
                                     f"{message} (tokenizer trained on {self._corpus})") from None
      if reused or inherited:
        self._check_tokenizer_covers(tokenizer, texts, path, refuse=not inherited)
    if jax.process_count() > 1:  # the others read process 0's file once it is written
      multihost_utils.sync_global_devices("sentencepiece model written")
    return tokenizer if jax.process_index() == 0 else tokenizers.SentencePieceTokenizer(path)

  @property
  def _corpus(self) -> str:
    """The training text, as messages name it."""
    data = self.config.data
    return f"data.train_file={data.train_file}" if data.source == "tsv" else f"the {data.target_locale} dates"

  @functools.cached_property
  def _decoded_indices(self) -> np.ndarray:
    """Which eval pairs extra_eval decodes and scores: while training, task.num_decode_examples (0 = all) evenly
    spaced from the first to the last, so that a file sorted by length, date or source samples all of it;
    --mode=eval, the final score, decodes every pair."""
    total, wanted = len(self.eval_pairs), self.config.task.num_decode_examples
    if self.mode == "eval" or not wanted or wanted >= total:
      return np.arange(total)
    return np.round(np.linspace(0, total - 1, wanted)).astype(np.int64)  # distinct: the spacing is >= 1

  @property
  def _decoded_pairs(self):
    return [self.eval_pairs[i] for i in self._decoded_indices]

  def _choose_bleu(self) -> bleu.BleuChoice:
    """eval/bleu's tokenizer for the decoded references (logged once by _log_bleu_choice). In training, a best
    checkpoint kept by an eval/bleu this corpus cannot define stops the run, naming the field."""
    setting = self.config.task.get("bleu_tokenize", "auto")
    choice = bleu.bleu_choice([target for _, target in self._decoded_pairs], setting)
    best = self.config.checkpoint.best_metric
    if not choice.defined and self.mode == "train" and best == "eval/bleu":
      others = [name for name in self.eval_metric_names if name != best]
      raise validation.ConfigError("checkpoint.best_metric", best, f"eval/bleu is undefined for this corpus: "
                                   f"{choice.reason}. Allowed are '' (no best checkpoint) or {others}")
    return choice

  def _log_bleu_choice(self) -> None:
    """Logs eval/bleu's tokenizer or why BLEU is undefined, once the task is set up (a config refused
    later in the constructor stays one line)."""
    if self._bleu.defined:
      logging.info("eval/bleu: sacrebleu tokenize=%r (task.bleu_tokenize=%r): %s", self._bleu.tokenize,
                   self.config.task.get("bleu_tokenize", "auto"), self._bleu.reason)
    else:
      logging.warning("eval/bleu is undefined for this corpus and left out of metrics.jsonl and TensorBoard: %s",
                      self._bleu.reason)

  def _take_init_from_tokenizer(self, path: str):
    """Fine-tuning from `init_from` keeps that run's vocabulary: its embedding rows belong to its
    pieces, so its SentencePiece model is copied in (a tokenizer trained on the new corpus would
    give the same pieces other ids). A workdir that already has another tokenizer is refused."""
    if not self.config.init_from:
      return False
    source = next((os.path.join(d, SPM_FILE) for d in _upward(self.config.init_from, 3)
                   if os.path.isfile(os.path.join(d, SPM_FILE))), None)
    if source is None:  # init_from's run moved or deleted: a fine-tune resumed here keeps what it copied in then
      return os.path.exists(path)
    if not os.path.exists(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
      shutil.copyfile(source, path)
      logging.info("Using the tokenizer of init_from's run, %s", source)
    elif not filecmp.cmp(source, path, shallow=False):
      raise validation.ConfigError("init_from", self.config.init_from,
                                   f"its run's tokenizer {source} differs from this workdir's {path}: the "
                                   "parameters would be read with other token ids; use a new --workdir")
    return True

  def _check_tokenizer_covers(self, tokenizer, texts, path: str, refuse: bool):
    """A tokenizer not trained on this corpus must encode it: one kept from an earlier run of this
    workdir is refused if it cannot (an accident); init_from's is kept with a warning (fine-tuning
    on text with characters the pretrained vocabulary lacks is a choice, but not a silent one)."""
    unk = tokenizer.unk_id
    missing = [text for text, ids in zip(texts, tokenizer.encode_batch(texts)) if unk in ids]
    if not missing:
      return
    unknown = sorted({c for text in missing for c in text if unk in tokenizer.encode(c)})
    data = self.config.data
    what = (f"cannot encode {unknown[:8]} of {self._corpus} ({len(missing)} training texts, e.g. "
            f"{missing[0][:60]!r})")
    if not refuse:
      logging.warning("The tokenizer of init_from's run %s %s: those characters train as the unknown piece",
                      path, what)
      return
    field = "data.train_file" if data.source == "tsv" else "data.target_locale"
    raise validation.ConfigError(field, data[field.split(".")[1]], f"the tokenizer kept in {path} (trained on an "
                                 f"earlier corpus) {what}; use a new --workdir")

  def _saved_tokenizer(self) -> tokenizers.Tokenizer:
    if self.config.data.tokenizer == "bytes":
      return tokenizers.ByteTokenizer()
    path = os.path.join(self.workdir or "", SPM_FILE)
    if not os.path.isfile(path):
      raise ValueError(f"{self.mode} needs the SentencePiece model the run trained, {path}, which is missing")
    return tokenizers.SentencePieceTokenizer(path)

  def _batches(self, pairs):
    data = self.config.data
    # 0 ("the longest example") never means longer than the model's positions: the few longest
    # examples are truncated there (with a warning saying how many), not the run stopped.
    return batching.TranslationBatches.from_pairs(
        pairs, self.tokenizer, max_source_length=data.max_source_length or None,
        max_target_length=data.max_target_length or None, length_bucketing=data.length_bucketing,
        packing=data.packing, length_limit=self.config.model.max_length)

  def _check_eval_lengths(self):
    """Eval examples are never truncated, so each must fit model.max_length (source tokens, and target
    tokens plus BOS / EOS); checked before training, naming the eval file's line."""
    limit, data = self.config.model.max_length, self.config.data
    lengths = zip(self.eval_data.source_lengths, self.eval_data.target_lengths)  # untruncated; EOS counted
    too_long = [(i, int(s), int(t)) for i, (s, t) in enumerate(lengths) if s > limit or t > limit]
    if not too_long:
      return
    i, s, t = too_long[0]
    if data.source == "dates":
      where = f"eval date pair {i}"
    else:
      path, lines = self._eval_lines
      where = f"{path}:{lines[i]}"
    more = f" (and {len(too_long) - 1} more)" if len(too_long) > 1 else ""
    raise validation.ConfigError(
        "model.max_length", limit, f"{where}: an eval example of {s} source / {t} target tokens does not "
        f"fit{more}; raise model.max_length or shorten the eval examples")

  def _note_padding(self):
    """Fixed-shape batches pad every example to the longest training example: one long line in a user's
    corpus can make most of each step padding (commit ae3ba84 measured one). Said once, with the remedies,
    when the rows hold over twice the slots that each example padded to its own length would."""
    data, batches = self.config.data, self.train_batches
    if data.length_bucketing or data.packing:
      return
    own = float(batches.length_buckets.sum() * batches.pad_multiple)
    slots = batches.num_units * (batches.max_source_length + batches.max_target_length)
    if own and slots > 2 * own:
      logging.warning("%s: rows are padded to %d source / %d target tokens (the longest example), %.1fx the token "
                      "slots of each example padded to its own length; --config.data.length_bucketing=True pads "
                      "each batch to its own examples (one compile per bucket shape), or set "
                      "data.max_source_length / max_target_length (longer examples are truncated)", self._corpus,
                      batches.max_source_length, batches.max_target_length, slots / own)

  def _note_small_corpus(self):
    """A corpus with fewer training examples (or packed rows) than batch_size fills each batch by repeating
    them (batching.epoch_order); said once, so a duplicated example is never a surprise."""
    units, size = self.train_batches.num_units, self.config.batch_size
    if units < size:
      what = "packed rows" if self.config.data.packing else "examples"
      logging.warning("%s gives %d training %s, fewer than batch_size=%d: every batch holds each of them %s",
                      self._corpus, units, what, size, batching.repeats_per_batch(units, size))

  @functools.cached_property
  def train_batches(self) -> batching.TranslationBatches:
    with warnings.catch_warnings():  # said below, naming the corpus's lines
      warnings.filterwarnings("ignore", message=r".* examples are longer than max_source_length")
      batches = self._batches(self.train_pairs)
    self._note_truncated(batches)
    return batches

  def _note_truncated(self, batches):
    """Training pairs longer than the rows are cropped to them, not the run stopped; said once, naming the
    first few by file and line and the setting that sets each row length."""
    if not batches.num_truncated:
      return
    data, limit = self.config.data, self.config.model.max_length
    def row(side, length):
      set_by = f"data.max_{side}_length" if data.get(f"max_{side}_length") else f"within model.max_length={limit}"
      return f"{side} {length}, {set_by}"
    rows = "; ".join((row("source", batches.max_source_length), row("target", batches.max_target_length)))
    if data.source == "dates":
      where = [f"date pair {index}" for index in batches.truncated[:3]]
    else:
      path, lines = self._train_lines
      where = [f"{path}:{lines[index]}" for index in batches.truncated[:3]]
    logging.warning("%d of the %d training pairs are longer than the rows (tokens, the target's EOS included: %s) and "
                    "are cropped to them: %s%s", batches.num_truncated, len(self.train_pairs), rows, ", ".join(where),
                    ", ..." if batches.num_truncated > 3 else "")

  @functools.cached_property
  def eval_data(self) -> batching.TranslationBatches:
    # Eval sources and targets may be longer than any training example; never truncate them.
    return batching.TranslationBatches.from_pairs(self.eval_pairs, self.tokenizer)

  # --- model and losses -------------------------------------------------------------------------

  def make_model(self, rngs, *, dtype, param_dtype):
    model = self.config.model
    encoder, decoder = stack_sizes(model)
    randomized = translator_lib.RandomizedPositions(max_position=model.get("randomized_positions_max", 0),
                                                    at_eval=model.get("randomized_positions_at_eval", False))
    return translator_lib.Translator(
        self.vocab_size, encoder=encoder, decoder=decoder, position_encoding=model.position_encoding,
        max_length=model.max_length, randomized_positions=randomized, rope_scaling=model.get("rope_scaling") or None,
        rope_scaling_factor=model.get("rope_scaling_factor", 1.0), share_embeddings=model.share_embeddings,
        tie_output=model.tie_output,
        norm=model.norm, dropout_rate=model.dropout_rate, attention_dropout_rate=model.attention_dropout_rate,
        activation=model.activation, scan_layers=model.scan_layers, remat=model.remat,
        implementation=model.implementation or None, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def steps_per_epoch(self):
    return self.train_batches.steps_per_epoch(self.config.batch_size)

  def train_batch(self, step, *, process_index, process_count):
    task_lib.check_reads_data(self, "train_batch")
    return self.train_batches.train_batch(step, seed=self.config.seed, batch_size=self.config.batch_size,
                                          process_index=process_index, process_count=process_count)

  def _logits(self, model, batch, deterministic=True, position_rng=None):
    packing = {argument: batch[key] for key, argument in _PACKING_KEYS.items() if key in batch}
    return model(batch["inputs"], batch["decoder_inputs"], deterministic=deterministic, position_rng=position_rng,
                 **packing)

  def loss_terms(self, model, batch, *, rngs):
    """Summed (label-smoothed) cross-entropy of the target tokens and their count; no aux."""
    # The loop has reseeded the model's dropout streams for this step; rngs draw its randomized
    # positions, if the model has them (a pure function of (seed, step)).
    logits = self._logits(model, batch, deterministic=False, position_rng=rngs.positions())  # -> [b, t, vocab]
    return (*optim.cross_entropy(logits, batch["targets"], batch["targets"] != 0, self.config.task.label_smoothing),
            {})

  def eval_batches(self, *, process_index, process_count):
    task_lib.check_reads_data(self, "eval_batches")
    return self.eval_data.eval_batches(self.config.eval_batch_size, process_index=process_index,
                                       process_count=process_count)

  def eval_metrics(self, model, batch):
    """loss and accuracy of the teacher-forced target tokens (EOS included) of every eval pair."""
    logits = self._logits(model, batch)
    weights = (batch["targets"] != 0) * batch["example_weights"][:, None]  # -> [b, t]
    # The loss without smoothing, so it is comparable across label_smoothing settings.
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["targets"], weights)
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == batch["targets"]) * weights)
    return {"loss": (loss_sum, weight_sum), "accuracy": (correct, weight_sum)}

  # --- decoding ---------------------------------------------------------------------------------

  def translate_ids(self, model, inputs: np.ndarray, max_length: int, row_ids=None) -> list[str]:
    """Decodes inputs [n, s] as task.decoding says, in batches of eval_batch_size (the last one padded; fewer
    rows, a smaller batch: `sharding.rows_batch_size`) -> n strings. Row i samples with its own key
    (task.decoding.seed, row_ids[i], default i), whatever the batching."""
    size = sharding.rows_batch_size(len(inputs), self.config.eval_batch_size, self.rows_sharding)
    outputs = []
    for start in range(0, len(inputs), size):
      chunk = inputs[start:start + size]
      padded = np.pad(chunk, ((0, size - len(chunk)), (0, 0)))  # one compiled shape for every chunk
      padded[len(chunk):, 0] = self.tokenizer.eos_id  # padding rows need one real source token
      # Rows split over the data axes (each device decodes its share; with host arrays every device
      # and every process decoded every row), gathered back whole on every process.
      chunk_ids = None if row_ids is None else [*row_ids[start:start + size], *[0] * (size - len(chunk))]
      rng = decoding_config.row_keys(self.config, size, offset=start, ids=chunk_ids)
      ids = self._generate(model, sharding.rows_on_mesh(padded, self.rows_sharding), max_length=max_length,
                           bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id, options=self.options,
                           rng=rng, suppress_ids=self.tokenizer.never_generated_ids,
                           logits_sharding=self.logits_sharding)
      outputs += [self.tokenizer.decode(row) for row in sharding.rows_to_host(ids)[:len(chunk)]]
    return outputs

  def _max_decode_length(self) -> int:
    # The search stops once every row has emitted EOS, so a generous bound costs little.
    return self.config.task.max_decode_length or self.config.model.max_length

  def extra_eval(self, model):
    """exact_match, bleu and chrf of the decoded pairs (the module docstring says what each measures);
    bleu is left out, with a log line saying why, where this corpus cannot define it."""
    task_lib.check_reads_data(self, "extra_eval")
    task = self.config.task
    pairs = self._decoded_pairs
    inputs = np.concatenate([batch["inputs"] for batch in self.eval_data.eval_batches(self.config.eval_batch_size)])
    inputs = inputs[self._decoded_indices]
    hypotheses = self.translate_ids(model, inputs, self._max_decode_length())
    references = [target for _, target in pairs]
    for (source, target), hypothesis in list(zip(pairs, hypotheses))[:task.num_samples_logged]:
      logging.info("sample translation: %r -> %r (reference %r)", source, hypothesis, target)
    if self.figure_directory and jax.process_index() == 0:
      self._plot_attention(model, inputs[:task.num_attention_plots])
    metrics = {"exact_match": float(np.mean([h == r for h, r in zip(hypotheses, references)]))}
    if self._bleu.defined:
      metrics["bleu"] = bleu.corpus_bleu(hypotheses, references, self._bleu.tokenize)
    else:
      logging.info("eval/bleu left out: undefined for this corpus (%s)", self._bleu.reason)
    metrics["chrf"] = sacrebleu.corpus_chrf(hypotheses, [references]).score
    return metrics

  def evaluated_name(self) -> str:
    """What eval reads, as a file name's part: data.eval_split ('validation' or 'test'), or for a data.eval_file its
    base name and the first 8 hex digits of the SHA-256 of its absolute path (files of one name in two folders)."""
    eval_file = self.config.data.get("eval_file")
    if not eval_file:
      return self.config.data.get("eval_split", "validation")  # absent from configs written before it existed
    path_digest = hashlib.sha256(os.path.abspath(eval_file).encode()).hexdigest()[:8]
    return f"{os.path.basename(eval_file)}-{path_digest}"

  def _attention_plot_paths(self, count: int) -> list[str]:
    """The `count` PNG paths of this eval's cross-attention maps (`task.figure_family`: an earlier eval's beyond them
    are removed). --mode=eval names what it evaluated, so that evals of one step on other sides or files keep each
    other's; training keeps its own names (it reads one eval side)."""
    prefix = "cross_attention_" if self.mode == "train" else f"cross_attention_{self.evaluated_name()}_"
    return task_lib.figure_family(os.path.join(self.figure_directory, "plots"), prefix, count)

  def _plot_attention(self, model, inputs):
    """Cross-attention maps of the model's own translations of inputs [n, s], one PNG each (none for n = 0: the
    family's earlier PNGs are removed)."""
    paths = self._attention_plot_paths(len(inputs))
    if not paths:
      return
    generated = np.asarray(self._generate(model, jnp.asarray(inputs), max_length=self._max_decode_length(),
                                          bos_id=self.tokenizer.bos_id, eos_id=self.tokenizer.eos_id,
                                          suppress_ids=self.tokenizer.never_generated_ids))
    decoder_inputs = np.concatenate([np.full((len(inputs), 1), self.tokenizer.bos_id, np.int32),
                                     generated[:, :-1]], axis=1)
    weights = np.asarray(self._attention(model, jnp.asarray(inputs), jnp.asarray(decoder_inputs)))
    for k, path in enumerate(paths):
      source = [self.tokenizer.id_to_piece(i) for i in inputs[k] if i != 0]
      length = int(np.argmax(generated[k] == self.tokenizer.eos_id)) + 1 if (
          generated[k] == self.tokenizer.eos_id).any() else generated.shape[1]
      target = [self.tokenizer.id_to_piece(i) for i in generated[k, :length]]
      figure = translate_plots.plot_cross_attention(weights[:, k, :, :length, :len(source)], source, target,
                                                    path, per_head=self.config.task.attention_per_head)
      translate_plots.close(figure)

  def infer_lines(self, model, lines):
    """One translation per input line, with the whitespace around it removed as the training pairs' is (`tsv`).
    A line longer than the model's sources (model.max_length tokens) is translated from its first ones, as
    training crops a long pair, and logged: the other lines' translations do not wait on it."""
    limit = self.config.model.max_length
    lines = [line.strip() for line in lines]
    # A training source holds no tab (`tsv`): a tab here is most likely a pairs file's line, whose target would be
    # translated with its source (the tab read as the unknown piece, unwarned).
    if tabbed := [index for index, line in enumerate(lines) if "\t" in line]:
      raise task_lib.InputLineError.of([(index, "holds a tab: an infer line is a source alone, as the training "
                                                "pairs' sources are (a pairs file's sources: `cut -f1 pairs.tsv`)")
                                        for index in tabbed])
    self.tokenizer.warn_unknown_characters(lines, "the input lines")
    encoded = self.tokenizer.encode_batch(lines)
    if empty := [index for index, ids in enumerate(encoded) if not ids]:
      raise task_lib.InputLineError.of([(index, "0 tokens; the model takes 1 or more") for index in empty])
    cropped = [index for index, ids in enumerate(encoded) if len(ids) > limit]
    if cropped:
      logging.warning("infer: %d line(s) hold more tokens than the model's sources take (model.max_length=%d): "
                      "each is translated from its first %d tokens (%s)", len(cropped), limit, limit,
                      ", ".join(f"line {self.line_number(index)}: {len(encoded[index])} tokens"
                                for index in cropped[:5]) + (", ..." if len(cropped) > 5 else ""))
      encoded = [ids[:limit] for ids in encoded]
    inputs = np.zeros((len(lines), batching.round_up(max(map(len, encoded)), 8)), np.int32)
    for row, ids in enumerate(encoded):
      inputs[row, :len(ids)] = ids
    # a line samples by its own number among the caller's lines, whatever lines come before it
    return self.translate_ids(model, inputs, self._max_decode_length(),
                              row_ids=[self.line_number(index) - 1 for index in range(len(lines))])
