"""Length generalization of a decoder-only model: `input SEP output` on copy, reverse, sort, duplicate, parity.

Training draws input lengths from [task.min_length, task.train_max_length]; evaluation holds
task.num_eval_examples strings per band of task.eval_bands ("1-20,21-40,41-80") and logs per band
  eval/exact_match_LO_HI     share of examples whose whole output (EOS included) is right
  eval/token_accuracy_LO_HI  share of output tokens (EOS included) that are right
besides eval/loss and eval/token_accuracy over the output tokens of every band. As in the
encoder-decoder version (tasks/algorithmic.py) exact match is read from the teacher-forced pass:
every output position right given the gold prefix is the same event as greedy decoding returning
the output. Only output tokens carry loss (data/lm_algorithmic.py).

Infer: a line of letters ('a' = the first symbol) -> the output letters, decoded by task.decoding.
"""
from __future__ import annotations

import string

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax.data import lm_algorithmic
from xattn_jax.tasks import algorithmic as seq2seq_algorithmic
from xattn_jax.tasks import decoding_config
from xattn_jax.tasks.lm import text as text_task
from xattn_jax.training import optim, task as task_lib, validation

_TRAIN_STREAM, _EVAL_STREAM = 0, 1
LETTERS = string.ascii_lowercase


@task_lib.register("lm_algorithmic")
class LMAlgorithmicTask(task_lib.Task):
  """Decoder-only algorithmic sequences; exact match per length band (see the module docstring)."""
  name = "lm_algorithmic"
  position_encodings = staticmethod(text_task.LanguageModelTask.position_encodings)

  @classmethod
  def validate(cls, config, mode="train"):
    task = config.task
    text_task.validate_model(config)
    validation.require_choice(config, "task.operation", lm_algorithmic.OPERATIONS)
    validation.require_positive(config, "task.min_length", "task.train_max_length", "task.num_eval_examples")
    if not validation.is_number(task.num_symbols) or not 2 <= task.num_symbols <= len(LETTERS):
      raise validation.ConfigError("task.num_symbols", task.num_symbols, f"must be in [2, {len(LETTERS)}]")
    if task.min_length > task.train_max_length:
      raise validation.ConfigError("task.min_length", task.min_length,
                                   f"must be <= task.train_max_length={task.train_max_length}")
    longest = cls.positions_needed(config)  # parses task.eval_bands
    # The model is built with `longest` positions whatever model.max_length says (positions_for); the field is there
    # for the shared LM checks. A value other than that, or one configs/lm_algorithmic.py writes (the row of its
    # :operation= at CONFIG_LONGEST_INPUT symbols, kept where --config.task.* change the rows), would be ignored.
    written = {lm_algorithmic.row_width(operation, lm_algorithmic.CONFIG_LONGEST_INPUT) + 1
               for operation in lm_algorithmic.OPERATIONS}
    if mode == "train" and config.model.max_length != longest and config.model.max_length not in written:
      raise validation.ConfigError("model.max_length", config.model.max_length,
                                   f"lm_algorithmic builds its model with the positions of its longest row, {longest} "
                                   f"(task.operation, task.train_max_length and task.eval_bands set it): use {longest} "
                                   "or the config's value, and change task.eval_bands for longer rows")
    decoding_config.decoding_options(config)
    randomized = config.model.get("randomized_positions_max", 0)
    if randomized and randomized < longest:
      raise validation.ConfigError("model.randomized_positions_max", randomized,
                                   f"must be >= {longest}, the longest row the model sees (the longest eval band's), "
                                   "or 0 = off")

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    task = config.task
    self.bands = seq2seq_algorithmic.parse_bands(task.eval_bands)
    self.options = decoding_config.decoding_options(config)
    # Positions 0 .. the longest eval row must have a row in a learned table.
    self.max_length = seq2seq_algorithmic.positions_for(config, workdir, mode, self.positions_needed)
    self._generate = nnx.jit(text_task.generate_ids,
                             static_argnames=("capacity", "max_new_tokens", "options", "logits_sharding"))

  @staticmethod
  def positions_needed(config) -> int:
    """Positions of the longest row a config trains or evaluates on (a ConfigDict or a recorded config's dict)."""
    task = config["task"]
    longest = max(task["train_max_length"], *(hi for _, hi in seq2seq_algorithmic.parse_bands(task["eval_bands"])))
    return lm_algorithmic.row_width(task["operation"], longest) + 1

  def make_model(self, rngs, *, dtype, param_dtype):
    return text_task.make_language_model(self.config.model, lm_algorithmic.vocab_size(self.config.task.num_symbols),
                                         max_length=self.max_length, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def _examples(self, rng, count, min_length, max_length):
    task = self.config.task
    return lm_algorithmic.make_examples(rng, count, operation=task.operation, min_length=min_length,
                                        max_length=max_length, num_symbols=task.num_symbols)

  def train_batch(self, step, *, process_index, process_count):
    task, size = self.config.task, self.config.batch_size // process_count
    rng = np.random.default_rng([self.config.seed, _TRAIN_STREAM, step])
    batch = self._examples(rng, self.config.batch_size, task.min_length, task.train_max_length)
    del batch["lengths"]
    return {k: v[process_index * size:(process_index + 1) * size] for k, v in batch.items()}

  def _sums(self, model, batch, position_rng=None):
    logits = model(batch["inputs"], position_rng=position_rng)  # -> [b, t, vocab]
    weights = batch["weights"]
    if "example_weights" in batch:
      weights = weights * batch["example_weights"][:, None]
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["targets"], weights)
    return logits, weights, loss_sum, weight_sum

  def loss_terms(self, model, batch, *, rngs):
    # The step's rngs draw its randomized positions, if the model has them (a pure function of (seed, step)).
    _, _, loss_sum, weight_sum = self._sums(model, batch, position_rng=rngs.positions())
    return loss_sum, weight_sum, {}

  def eval_batches(self, *, process_index, process_count):
    """Each band's examples in batches of eval_batch_size at the band's width (weight-0 rows fill up)."""
    for index, (lo, hi) in enumerate(self.bands):
      rng = np.random.default_rng([self.config.seed, _EVAL_STREAM, index])
      examples = self._examples(rng, self.config.task.num_eval_examples, lo, hi)
      del examples["lengths"]
      examples["example_weights"] = np.ones(len(examples["inputs"]), np.float32)
      examples["band"] = np.full(len(examples["inputs"]), index, np.int32)
      yield from seq2seq_algorithmic.padded_batches(examples, self.config.eval_batch_size,
                                                    process_index=process_index, process_count=process_count)

  def eval_metrics(self, model, batch):
    logits, weights, loss_sum, weight_sum = self._sums(model, batch)
    correct = (jnp.argmax(logits, axis=-1) == batch["targets"]) | (weights == 0)  # [b, t]
    metrics = {"loss": (loss_sum, weight_sum), "token_accuracy": (jnp.sum(correct * weights), weight_sum)}
    metrics.update(seq2seq_algorithmic.band_metrics(self.bands, correct, weights, batch["example_weights"],
                                                    batch["band"]))
    return metrics

  def infer_lines(self, model, lines):
    """Each line of letters -> the operation's output letters, decoded with task.decoding."""
    task = self.config.task
    symbols = LETTERS[:task.num_symbols]
    def prompt(index, line):
      text = line.strip()
      if not text or lm_algorithmic.row_width(task.operation, len(text)) >= self.max_length or \
          any(ch not in symbols for ch in text):
        raise ValueError(f"needs letters from {symbols!r}, short enough for the model's {self.max_length} "
                         f"positions, got {text!r}")
      ids = [lm_algorithmic.FIRST_SYMBOL + symbols.index(ch) for ch in text]
      return [lm_algorithmic.BOS_ID, *ids, lm_algorithmic.sep_id(task.num_symbols)]
    prompts = task_lib.read_each(lines, prompt)
    width = max(map(len, prompts))
    new = self.max_length - width
    tokens, valid = text_task.lm_lib.left_pad(prompts, width)
    rng = decoding_config.row_keys(self.config, len(lines),  # by line number, whatever lines come before it
                                   ids=[self.line_number(index) - 1 for index in range(len(lines))])
    outputs = np.asarray(self._generate(model, jnp.asarray(tokens), jnp.asarray(valid), rng, capacity=width - 1 + new,
                                        max_new_tokens=new, options=self.options, logits_sharding=self.logits_sharding))
    first, last = lm_algorithmic.FIRST_SYMBOL, lm_algorithmic.FIRST_SYMBOL + task.num_symbols
    answers = []
    for row in outputs:
      end = int(np.argmax(row == lm_algorithmic.EOS_ID)) if (row == lm_algorithmic.EOS_ID).any() else len(row)
      answers.append("".join(symbols[i - first] for i in row[:end] if first <= i < last) or "(none)")
    return answers
