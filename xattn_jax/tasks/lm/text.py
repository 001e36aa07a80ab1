"""Causal language modelling: the decoder-only LanguageModel on the bundled corpus or a user's text file.

Config (see configs/lm_text.py):
  data.train_file     "" = the bundled corpus (data.corpus.default_corpus: CLDR text and number words),
                      else a UTF-8 file, one document per line (errors name file:line)
  data.file_format    (optional) how those files become documents (FILE_FORMATS): "lines" (the default), or
                      "image_text": the text of each `image_path<TAB>text` line after the image's marker,
                      "<image> text" (data.image_text; images not opened), the LM a VLM reads a user's
                      pairs with (configs/vlm_lm.py:text=pairs)
  data.source         (optional) a name in GENERATED_CORPORA instead of either: a generated corpus, e.g.
                      "vlm_digits" (data.vlm_digits.lm_corpus: data.num_train_documents texts of
                      "train" and data.num_eval_documents of "validation" examples with up to data.max_digits
                      digits, the VLM's text alone; with data.describe_images each example gives two,
                      the second with its images described in words; configs/vlm_lm.py)
  data.eval_file      "" = hold out data.eval_fraction of the training documents (by a stable hash of
                      the text; a file of one document: its last eval_fraction of characters; the bundled
                      corpus has its own held-out side; --mode=eval reads the training file again and
                      scores the same held-out documents); data.num_eval_documents
                      keeps the first that many of them (0 = all); data.max_eval_rows (optional): each eval
                      while training scores the first that many packed eval rows (0 = all); --mode=eval
                      scores every row
  data.tokenizer      "bytes" or "sentencepiece" (trained into <workdir>/tokenizer/, reused on resume,
                      eval and infer); data.vocab_size is a cap unless data.vocab_size_exact;
                      data.single_piece_words (optional) words kept one piece each (e.g. "<image>")
  data.sequence_length  the packed row length (documents longer than a row are cut into chunks)
  data.eval_context   (optional) eval only: a chunk after a long document's first reads this many of its
                      tokens before the ones it scores (a sliding window; data.text.pack_documents), 0 = none
  model.*             LanguageModel options (position_encoding, norm_type, mlp_type, num_kv_heads, ...)
  model.randomized_positions_max / _at_eval   randomized positions per packed document (0 = off;
                      models.lm), drawn from the step's rngs in training
  task.decoding.*     method greedy | sample | beam and its options (tasks.decoding_config), and
                      max_new_tokens, for --mode=infer and the samples each eval logs
  task.num_samples_logged  (optional) each eval logs the model's continuation of the first half of this many
                      eval documents (evenly spaced through them), beside how each goes on (0 = none)

Documents are packed into rows (data.text.pack_documents): each is BOS d_1 .. d_n EOS, the model
learns its n + 1 next-token pairs, attention stays within a document and positions restart at it.

Metrics, logged as eval/<name> (an "eval token" is one next-token pair of an eval document, EOS
included, every pair of every eval document counted once):
  eval/loss            mean cross-entropy (nats) per eval token
  eval/token_accuracy  share of eval tokens whose most likely id is the true next token
  eval/perplexity      exp(eval/loss) (derived_eval: from the same sums, no second pass)
  eval/bits_per_byte   the summed cross-entropy in bits over the UTF-8 bytes of the eval text it scores (EOS:
                       1 byte, the line end; Tokenizer.token_bytes): comparable across tokenizers and vocabulary
                       sizes, as perplexity per token is not (the bytes tokenizer: eval/loss / ln 2)
How many eval tokens there are is logged when the task is built. A document longer than a row is
trained in chunks of data.sequence_length pairs, each without the context before it, and scored by a sliding
window: its first data.sequence_length pairs, then data.sequence_length - data.eval_context at a time, each after
the data.eval_context tokens before them (configs/lm_text.py: half the row; 0 scores the training chunks).
Infer: each input line is a prompt (BOS + its tokens; a blank line: BOS alone); the output line is the prompt
followed by the model's continuation (up to task.decoding.max_new_tokens tokens, stopping at EOS).
"""
from __future__ import annotations

import functools
import math
import os

import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from xattn_jax import decoding
from xattn_jax.data import batching, corpus, files, image_text, splits, text, tokenizers, vlm_digits
from xattn_jax.layers import blocks
from xattn_jax.models import lm as lm_lib
from xattn_jax.tasks import decoding_config, reading_fields
from xattn_jax.training import checkpoints, optim, sharding, task as task_lib, validation

TOKENIZERS = ("bytes", "sentencepiece")
# data.source -> (train documents, eval documents) generated from the data config.
GENERATED_CORPORA = {
    "vlm_digits": lambda data: vlm_digits.lm_corpus(num_train=data.num_train_documents,
                                                    num_eval=data.num_eval_documents, seed=data.corpus_seed,
                                                    max_digits=data.max_digits,
                                                    describe_images=data.get("describe_images", False)),
}
# data.file_format -> the documents of a data.train_file / data.eval_file (errors: files.LineFileError).
FILE_FORMATS = {
    "lines": text.read_documents,
    "image_text": lambda path: [f"{vlm_digits.IMAGE_TOKEN} {line}" for line in image_text.read_pair_texts(path)],
}
SPM_FILE = os.path.join("tokenizer", "sentencepiece.model")


def _file_format(data) -> str:
  return data.get("file_format", "lines")


def _read(field: str, path: str, file_format: str) -> list[str]:
  validation.require_file(field, path)
  try:
    return _read_cached(path, os.stat(path).st_mtime_ns, file_format)
  except files.LineFileError as error:
    raise validation.ConfigError(field, path, " ".join(str(error).split())) from None


@functools.lru_cache(maxsize=2)
def _read_cached(path: str, mtime_ns: int, file_format: str) -> list[str]:
  del mtime_ns  # part of the cache key only
  return FILE_FORMATS[file_format](path)


def validate_model(config) -> None:
  """The model.* fields of a LanguageModel config, as ConfigErrors."""
  model = config.model
  validation.require_choice(config, "model.name", ("lm",))
  validation.require_choice(config, "model.norm_type", blocks.NORM_TYPES)
  validation.require_choice(config, "model.mlp_type", blocks.MLP_TYPES)
  validation.require_choice(config, "model.activation", blocks.ACTIVATIONS)
  validation.require_choice(config, "model.tie_output", (True, False))
  # model.randomized_positions_max itself is checked with the position encoding (check_attention_dims).
  if "randomized_positions_at_eval" in model:
    validation.require_choice(config, "model.randomized_positions_at_eval", (True, False))
  validation.require_positive(config, "model.d_model", "model.num_heads", "model.num_layers", "model.mlp_dim",
                              "model.max_length")
  validation.require_positive(config, "model.num_kv_heads", allow_zero=True)
  if model.num_kv_heads and model.num_heads % model.num_kv_heads:
    raise validation.ConfigError("model.num_kv_heads", model.num_kv_heads,
                                 f"must divide model.num_heads={model.num_heads} (0 = num_heads)")


def make_language_model(model_config, vocab_size: int, *, max_length: int, dtype, param_dtype, rngs):
  """The LanguageModel of model_config (the model.* fields of configs/lm_text.py)."""
  m = model_config
  sections = tuple(m.get("mrope_sections", ())) or None
  randomized = lm_lib.RandomizedPositions(max_position=m.get("randomized_positions_max", 0),
                                          at_eval=m.get("randomized_positions_at_eval", False))
  return lm_lib.LanguageModel(
      vocab_size, d_model=m.d_model, num_heads=m.num_heads, num_layers=m.num_layers, mlp_dim=m.mlp_dim,
      num_kv_heads=m.num_kv_heads or None, position_encoding=m.position_encoding, max_length=max_length,
      randomized_positions=randomized,
      rope_scaling=m.get("rope_scaling") or None, rope_scaling_factor=m.get("rope_scaling_factor", 1.0),
      mrope_sections=sections, norm_type=m.norm_type, mlp_type=m.mlp_type, activation=m.activation,
      tie_output=m.tie_output, dropout_rate=m.dropout_rate, scan_layers=m.scan_layers, remat=m.remat,
      implementation=m.get("implementation") or None, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def generate_ids(model, tokens, valid, rng, *, capacity, max_new_tokens, options, suppress_ids=(),
                 logits_sharding=None):
  """Left-padded prompts tokens [b, t] (t >= 2) -> continuations [b, max_new_tokens] (EOS, then padding).

  The prompt but its last token fills the cache; the last token is fed first (decoding.search, which
  never emits suppress_ids; logits_sharding: `decoding.search`'s).
  """
  cache = model.init_cache(tokens.shape[0], capacity)
  _, cache = model.prefill(tokens[:, :-1], cache, valid=valid[:, :-1])
  return decoding.search(model.loop_step(), cache, options, batch_size=tokens.shape[0],
                         max_length=max_new_tokens, bos_id=tokenizers.BOS_ID, eos_id=tokenizers.EOS_ID,
                         rng=rng, first_tokens=tokens[:, -1], suppress_ids=suppress_ids,
                         logits_sharding=logits_sharding).tokens


@task_lib.register("lm")
class LanguageModelTask(task_lib.Task):
  """Next-token prediction on packed documents (see the module docstring)."""
  eval_metric_names = ("eval/loss", "eval/token_accuracy", "eval/perplexity", "eval/bits_per_byte")
  infers_blank_lines = True  # a blank line is an empty prompt: a sample from BOS alone
  position_encodings = staticmethod(lm_lib.position_encodings)
  held_out_fields = ("data.eval_fraction", "data.corpus_seed")

  @classmethod
  def validate(cls, config, mode="train"):
    data, model, task = config.data, config.model, config.task
    validate_model(config)
    validation.require_positive(config, "data.sequence_length", "task.decoding.max_new_tokens")
    validation.require_positive(config, "data.num_eval_documents", allow_zero=True)
    if "max_eval_rows" in data:  # a run's config.py written before the field existed has none
      validation.require_positive(config, "data.max_eval_rows", allow_zero=True)
    if "num_samples_logged" in task:  # likewise
      validation.require_positive(config, "task.num_samples_logged", allow_zero=True)
    if task.decoding.max_new_tokens > model.max_length - 2:  # BOS and one prompt token at least
      raise validation.ConfigError("task.decoding.max_new_tokens", task.decoding.max_new_tokens,
                                   f"must be <= model.max_length - 2 = {model.max_length - 2}: a prompt's BOS, its "
                                   "tokens and the new ones share the model's positions")
    if data.sequence_length > model.max_length:
      raise validation.ConfigError("data.sequence_length", data.sequence_length,
                                   f"must be <= model.max_length={model.max_length}")
    if "eval_context" in data:  # a run's config.py written before the field existed has none
      validation.require_positive(config, "data.eval_context", allow_zero=True)
      if data.eval_context >= data.sequence_length:
        raise validation.ConfigError("data.eval_context", data.eval_context,
                                     f"must be < data.sequence_length={data.sequence_length}: each eval chunk scores "
                                     "the tokens after its context")
    validation.require_choice(config, "data.tokenizer", TOKENIZERS)
    validation.require_choice(config, "data.vocab_size_exact", (True, False))
    if data.tokenizer == "sentencepiece":
      validation.require_positive(config, "data.vocab_size")
    if not validation.is_number(data.eval_fraction) or not 0 < data.eval_fraction < 1:
      raise validation.ConfigError("data.eval_fraction", data.eval_fraction, "must be in (0, 1)")
    decoding_config.decoding_options(config)
    if data.get("source", ""):
      validation.require_choice(config, "data.source", GENERATED_CORPORA)
      if data.train_file or data.eval_file:
        raise validation.ConfigError("data.source", data.source, "a generated corpus takes no data.train_file "
                                     "or data.eval_file; set them to '' or data.source to ''")
      validation.require_positive(config, "data.num_train_documents", "data.num_eval_documents", "data.max_digits")
      if data.max_digits > vlm_digits.MAX_DIGITS:
        raise validation.ConfigError("data.max_digits", data.max_digits, f"must be in [1, {vlm_digits.MAX_DIGITS}]")
    if "file_format" in data:
      validation.require_choice(config, "data.file_format", FILE_FORMATS)
      if data.file_format != "lines" and mode == "train" and not data.train_file:
        raise validation.ConfigError("data.train_file", data.train_file, f"data.file_format={data.file_format!r} "
                                     "reads the documents from a file: name one")
    if data.train_file and (mode == "train" or (mode == "eval" and not data.eval_file)):
      _read("data.train_file", data.train_file, _file_format(data))
    if mode != "infer" and data.eval_file:
      _read("data.eval_file", data.eval_file, _file_format(data))

  @classmethod
  def eval_model_fields(cls, config):
    """Eval and infer may read a run with a longer context (model.max_length, but where it sizes a learned table),
    RoPE rescaled, drawn positions or another attention implementation (tasks.reading_fields): ALiBi's "train
    short, test long" is `--mode=eval` with a longer data.sequence_length and model.max_length."""
    return reading_fields.position_reading_fields(config)

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    self.options = decoding_config.decoding_options(config)
    self.train_texts, self.eval_texts = self._texts() if mode != "infer" else ((), ())
    self.tokenizer = self._tokenizer(self.train_texts if mode == "train" else None)
    self.vocab_size = self.tokenizer.vocab_size
    decoding_config.note_top_k(config, self.vocab_size)
    length = config.data.sequence_length
    if mode == "train":
      self.train_data = text.TextBatches.from_texts(self.train_texts, self.tokenizer, length=length,
                                                    pack_seed=config.seed)
      rows = self.train_data.num_rows
      if rows < config.batch_size:  # batches repeat the rows (batching.epoch_order); said once
        logging.warning("the training text packs into %d rows of %d, fewer than batch_size=%d: every batch holds "
                        "each row %s", rows, length, config.batch_size,
                        batching.repeats_per_batch(rows, config.batch_size))
    if mode != "infer":
      self.tokenizer.warn_unknown_characters(self.eval_texts, "the eval documents",
                                             ": a run of them is scored as one token")
      self.eval_data = text.TextBatches.from_texts(self.eval_texts, self.tokenizer, length=length,
                                                   context=config.data.get("eval_context", 0), count_bytes=True)
      logging.info("LM eval: %d documents, %d tokens (next-token pairs, EOS included) in %d rows of %d",
                   len(self.eval_texts), int(self.eval_data.packed.weights.sum()), self.eval_data.num_rows, length)
      cap = config.data.get("max_eval_rows", 0) if mode == "train" else 0  # --mode=eval, the final score: all
      if cap and self.eval_data.num_rows > cap:  # an eval of a large file's whole held-out side costs minutes
        self.eval_data = self.eval_data.first_rows(cap)
        logging.info("LM eval scores the first %d of those rows (%d tokens; data.max_eval_rows, 0 = all)", cap,
                     int(self.eval_data.packed.weights.sum()))
    self._generate = nnx.jit(generate_ids, static_argnames=("capacity", "max_new_tokens", "options", "suppress_ids",
                                                             "logits_sharding"))

  # --- data -------------------------------------------------------------------------------------

  def _texts(self):
    data = self.config.data
    if data.get("source", ""):
      train, evaluation = GENERATED_CORPORA[data.source](data)
    elif not data.train_file:
      bundled = corpus.default_corpus(seed=data.corpus_seed)
      train, evaluation = list(bundled.train), list(bundled.eval)
    else:
      # Eval without an eval file scores the held-out side of the same split that training held out.
      held_out = not data.eval_file
      read = self.mode == "train" or held_out
      train = _read("data.train_file", data.train_file, _file_format(data)) if read else []
      evaluation = []
      if held_out and _file_format(data) == "image_text":  # the pairs' own split, as the VLM and its encoder
        train, evaluation = (image_text.side_of_split(train, data.train_file, eval_side=side) for side in (False, True))
      elif held_out and len(train) == 1:  # one document (a book, text8): its tail is the held-out side
        train, evaluation = _split_tail(train[0], data.eval_fraction, data.train_file)
      elif held_out and len(set(train)) == 1:  # held out by line, a split of one distinct line holds out nothing
        raise validation.ConfigError("data.eval_file", data.eval_file, f"data.train_file {data.train_file} holds "
                                     f"{len(train)} lines, all the same text: none can be held out for eval; name "
                                     "an eval file, or give data.train_file two distinct lines")
      elif held_out:
        # At least one held-out document where the file has two: a small file's eval_fraction can round to none.
        lines = len(set(train))
        train, evaluation = splits.split_by_key(train, lambda line: line, seed=data.corpus_seed,
                                                eval_fraction=data.eval_fraction, min_eval_keys=1)
        held = len(set(evaluation))
        if splits.far_below_fraction(held, lines, data.eval_fraction):
          logging.warning("data.train_file %s: %d of its %d distinct lines are held out for eval, where "
                          "data.eval_fraction=%g holds out about %d: its lines look drawn from the training side "
                          "of a split by the same hash and data.corpus_seed=%d (as the bundled corpus's are); set "
                          "another data.corpus_seed or name data.eval_file", data.train_file, held, lines,
                          data.eval_fraction, round(data.eval_fraction * lines), data.corpus_seed)
    if data.eval_file:
      evaluation = _read("data.eval_file", data.eval_file, _file_format(data))
      if data.train_file:  # an eval reads the training file where it is still there, to say so too
        trained_on = train or (_read("data.train_file", data.train_file, _file_format(data))
                               if os.path.isfile(data.train_file) else [])
        splits.warn_shared(evaluation, trained_on, data.eval_file, data.train_file, "documents")
    if data.num_eval_documents:
      evaluation = evaluation[:data.num_eval_documents]
    if not evaluation:
      raise validation.ConfigError("data.eval_file", data.eval_file, "no eval documents: name an eval file, or "
                                   "give data.train_file two distinct lines, or one long enough to hold out its tail")
    return tuple(train), tuple(evaluation)

  def _tokenizer(self, train_texts):
    data = self.config.data
    if data.tokenizer == "bytes":
      return tokenizers.ByteTokenizer()
    path = os.path.join(self.workdir or "", SPM_FILE)
    if train_texts is None:
      if not os.path.isfile(path):
        raise ValueError(f"{self.mode} needs the SentencePiece model the run trained, {path}, which is missing")
      return tokenizers.SentencePieceTokenizer(path)
    saved = bool(self.workdir) and bool(checkpoints.step_numbers(self.workdir))  # else no model read the tokenizer
    try:  # a resumed run keeps the model its checkpoints read, whatever an edited file now holds (the loop warns)
      tokenizer = tokenizers.train_sentencepiece(list(train_texts), path, vocab_size=data.vocab_size,
                                                 exact=data.vocab_size_exact,
                                                 single_piece_words=tuple(data.get("single_piece_words", ())),
                                                 texts_must_match=self.mode == "train" and not saved,
                                                 retrain_unread=not saved)
    except tokenizers.OtherTextsError as error:
      raise validation.ConfigError("data.train_file", data.train_file, str(error)) from None
    except ValueError as error:  # e.g. a text too small for an exact vocabulary: name the field that takes a cap
      message = " ".join(str(error).split()).replace("exact=False", "data.vocab_size_exact=False")
      raise validation.ConfigError("data.vocab_size", data.vocab_size, message) from None
    logging.info("SentencePiece vocabulary: %d pieces (data.vocab_size=%d, exact=%s)", tokenizer.vocab_size,
                 data.vocab_size, data.vocab_size_exact)
    return tokenizer

  # --- model and losses -------------------------------------------------------------------------

  def make_model(self, rngs, *, dtype, param_dtype):
    return make_language_model(self.config.model, self.vocab_size, max_length=self.config.model.max_length,
                               dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def steps_per_epoch(self):
    return batching.steps_per_epoch(self.train_data.num_rows, self.config.batch_size)

  def train_batch(self, step, *, process_index, process_count):
    task_lib.check_reads_data(self, "train_batch", ("train",))
    return self.train_data.train_batch(step, seed=self.config.seed, batch_size=self.config.batch_size,
                                       process_index=process_index, process_count=process_count)

  @staticmethod
  def _logits(model, batch, deterministic=True, position_rng=None):
    return model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                 position_rng=position_rng, deterministic=deterministic)

  def loss_terms(self, model, batch, *, rngs):
    """Summed cross-entropy of the next-token pairs and their count; padding (weight 0) counts nothing."""
    # The loop has reseeded the model's dropout streams; rngs draw the step's randomized positions (per
    # document of the packed rows), if the model has them.
    logits = self._logits(model, batch, deterministic=False, position_rng=rngs.positions())  # -> [b, t, vocab]
    return (*optim.cross_entropy(logits, batch["targets"], batch["weights"]), {})

  def eval_batches(self, *, process_index, process_count):
    task_lib.check_reads_data(self, "eval_batches")
    return self.eval_data.eval_batches(self.config.eval_batch_size, process_index=process_index,
                                       process_count=process_count)

  def eval_metrics(self, model, batch):
    """loss, token_accuracy and bits_per_byte over the eval tokens (see the module docstring)."""
    loss_sum, correct, weight_sum = self._sums(model, batch)
    return {"loss": (loss_sum, weight_sum), "token_accuracy": (correct, weight_sum),
            "bits_per_byte": (loss_sum / math.log(2), jnp.sum(batch["target_bytes"] * batch["weights"]))}

  def _sums(self, model, batch):
    logits = self._logits(model, batch)
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["targets"], batch["weights"])
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == batch["targets"]) * batch["weights"])
    return loss_sum, correct, weight_sum

  def derived_eval(self, metrics):
    """perplexity = exp(mean eval loss per token), from the summed eval loss (no second pass)."""
    return {"perplexity": math.exp(metrics["loss"])} if "loss" in metrics else {}

  def sample_documents(self) -> list[str]:
    """The task.num_samples_logged eval documents each eval continues: evenly spaced through the eval side (a
    corpus in sections, as the bundled one, shows each)."""
    count = min(self.config.task.get("num_samples_logged", 0), len(self.eval_texts))
    return [self.eval_texts[i] for i in np.linspace(0, len(self.eval_texts) - 1, count).round().astype(int)]

  def extra_eval(self, model):
    """No metric: logs the model's continuation of the first half of each of `sample_documents` (at most the
    tokens a prompt may hold) beside how the document goes on."""
    budget = self.config.model.max_length - 1 - self.config.task.decoding.max_new_tokens  # BOS and the new ones
    documents = self.tokenizer.encode_batch(self.sample_documents())
    prompts = [ids[:max(1, min(len(ids) // 2, budget))] for ids in documents]
    for prompt, ids, added in zip(prompts, documents, self._continuations(model, prompts) if prompts else ()):
      logging.info("sample: %r -> %r (the document goes on %r)", self.tokenizer.decode(prompt), added,
                   self.tokenizer.continuation(prompt, ids[len(prompt):]))
    return {}

  # --- inference --------------------------------------------------------------------------------

  def infer_lines(self, model, lines):
    """Each line continued by task.decoding's method: the prompt, then the model's continuation (a blank line:
    what the model writes after BOS alone). A prompt longer than the model's context (model.max_length less BOS
    and task.decoding.max_new_tokens) is continued from its last tokens that fit, as a causal LM reads a long
    text, and logged; the line is written whole."""
    budget = self.config.model.max_length - 1 - self.config.task.decoding.max_new_tokens
    self.tokenizer.warn_unknown_characters(lines, "the input lines")
    prompts = self.tokenizer.encode_batch(lines)
    cropped = [index for index, ids in enumerate(prompts) if len(ids) > budget]
    if cropped:
      logging.warning("infer: %d line(s) (the first: line %d, %d tokens) hold more tokens than the %d the model "
                      "reads before task.decoding.max_new_tokens=%d new ones (model.max_length=%d): each is "
                      "continued from its last %d tokens", len(cropped), self.line_number(cropped[0]), len(prompts[cropped[0]]),
                      budget, self.config.task.decoding.max_new_tokens, self.config.model.max_length, budget)
    prompts = [ids[len(ids) - budget:] if len(ids) > budget else ids for ids in prompts]
    return [_continue(line, added) for line, added in zip(lines, self._continuations(model, prompts))]

  def _continuations(self, model, prompts: list[list[int]]) -> list[str]:
    """The text task.decoding's method adds after each prompt (token ids, BOS not included; row i samples
    with key i), in batches of eval_batch_size (fewer rows, a smaller batch: `sharding.rows_batch_size`)."""
    new = self.config.task.decoding.max_new_tokens
    prompts = [[self.tokenizer.bos_id, *ids] for ids in prompts]
    # Few compiled shapes across calls, but a cache of at most model.max_length positions (a learned table's rows).
    width = min(-(-max(map(len, prompts)) // 8) * 8, self.config.model.max_length + 1 - new)
    size = sharding.rows_batch_size(len(prompts), self.config.eval_batch_size, self.rows_sharding)
    continuations = []
    for start in range(0, len(prompts), size):
      chunk = prompts[start:start + size]
      tokens, valid = lm_lib.left_pad(chunk + [chunk[-1]] * (size - len(chunk)), width)  # one batch shape
      rng = decoding_config.row_keys(self.config, size, offset=start)
      generated = self._generate(model, jnp.asarray(tokens), jnp.asarray(valid), rng, capacity=width - 1 + new,
                                 max_new_tokens=new, options=self.options,
                                 suppress_ids=self.tokenizer.never_generated_ids, logits_sharding=self.logits_sharding)
      continuations += list(np.asarray(generated)[:len(chunk)])  # -> [rows, new]
    return [self.tokenizer.continuation(prompt[1:], [i for i in row if i >= 0])
            for prompt, row in zip(prompts, continuations)]


def _split_tail(document: str, eval_fraction: float, path: str) -> tuple[list[str], list[str]]:
  """([head], [tail]) of a file's only document: the tail is its last eval_fraction of characters, cut at the
  first space from there (anywhere, for text without spaces), as a single stream is split for eval (text8,
  enwik8)."""
  start = int(len(document) * (1 - eval_fraction))
  space = document.find(" ", start)
  cut = space if 0 < space < len(document) - 1 else start
  head, tail = document[:cut].strip(), document[cut:].strip()
  if not head or not tail:
    return [document], []  # too short to split: refused below, naming the fix
  logging.info("data.train_file %s holds one document: its last %d of %d characters (data.eval_fraction=%g) are "
               "held out for eval", path, len(document) - cut, len(document), eval_fraction)
  return [head], [tail]


def _continue(line: str, added: str) -> str:
  """The input line followed by the text the model added: the tokenizer drops the line's trailing
  whitespace, so a continuation that opens with a space does not add a second one."""
  if line[-1:].isspace() and added[:1].isspace():
    added = added[1:]
  return line + added
