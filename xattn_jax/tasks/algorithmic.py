"""Length generalization: the encoder-decoder translator copies or reverses random symbol strings.

Training draws lengths from [task.min_length, task.train_max_length] (1..32 by default); evaluation
holds a fixed set of `task.num_eval_examples` strings per length band in `task.eval_bands`
("1-32,33-64,65-128"), and logs `eval/exact_match_LO_HI` and `eval/token_accuracy_LO_HI` per
band besides the loss and token accuracy over all of them. Token accuracy (EOS included) shows how
far a model gets when whole strings are not yet right.

Exact match is read from the teacher-forced pass: an output is an exact match when the argmax at
every target position (EOS included) is the target. That is the same event as greedy decoding
returning the target: if every teacher-forced prediction is right, each greedy step sees the gold
prefix and picks the gold token; if greedy returns the target, its prefixes were the gold ones. So
no decoding loop is needed for the metric.

Position tables: the model's `max_length` (and so a "learned" table, or any max_length_table encoding's)
covers the longest eval band plus EOS, but training only ever reaches rows 0..train_max_length, so rows
past it stay at their random initialisation (std 0.02). The learned encoding's long-band scores measure
exactly that, and the ablation's table says so.

Symbols print as letters 'a', 'b', ... for `launch.py --mode=infer` (one string per line).
"""
from __future__ import annotations

import string

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax import decoding
from xattn_jax.data import algorithmic
from xattn_jax.layers import positions as position_layers
from xattn_jax.models import translator as translator_lib
from xattn_jax.training import optim, task as task_lib, validation, workdir as workdir_lib

_TRAIN_STREAM, _EVAL_STREAM = 0, 1
LETTERS = string.ascii_lowercase


def parse_bands(text: str, field: str = "task.eval_bands") -> list[tuple[int, int]]:
  """"1-32,33-64" -> [(1, 32), (33, 64)]: inclusive length ranges, each non-empty and >= 1."""
  try:
    bands = [tuple(int(part) for part in item.split("-"))
             for item in validation.require_string(field, text, "1-32,33-64").split(",")]
  except ValueError:
    bands = []
  if not bands or any(len(band) != 2 or not 1 <= band[0] <= band[1] for band in bands):
    raise validation.ConfigError(field, text, "must be comma-separated LO-HI length ranges, e.g. 1-32,33-64")
  return bands


def positions_for(config, workdir, mode: str, positions_needed) -> int:
  """The positions the model is built with: `positions_needed(config)`, which follows task.eval_bands, a field
  eval and infer may change. A learned table (max_length_table), though, was trained with the rows the run's own
  bands needed: eval and infer build it as trained (the workdir's recorded config) and refuse bands beyond it,
  naming the field; other encodings read any position."""
  needed = positions_needed(config)
  recorded = workdir_lib.recorded_config(workdir) if workdir and mode != "train" else None
  if not recorded or not position_layers.get(config.model.position_encoding).max_length_table:
    return needed
  trained = positions_needed(recorded)
  if needed > trained:
    raise validation.ConfigError("task.eval_bands", config.task.eval_bands,
                                 f"need {needed} positions; the run's learned position table has {trained} (its "
                                 f"task.eval_bands {recorded['task']['eval_bands']!r}): name bands within them")
  return trained


def band_name(band: tuple[int, int], metric: str = "exact_match") -> str:
  return f"{metric}_{band[0]}_{band[1]}"


def padded_batches(examples: dict[str, np.ndarray], size: int, *, process_index: int, process_count: int):
  """examples cut into global batches of `size` rows (the last padded with zero rows, so weight 0), each
  yielded as this process's rows."""
  local = size // process_count
  for start in range(0, len(next(iter(examples.values()))), size):
    batch = {}
    for key, array in examples.items():
      chunk = array[start:start + size]
      batch[key] = np.pad(chunk, [(0, size - len(chunk))] + [(0, 0)] * (array.ndim - 1))
    yield {k: v[process_index * local:(process_index + 1) * local] for k, v in batch.items()}


def band_metrics(bands, correct, token_weights, example_weights, band_ids) -> dict[str, tuple]:
  """eval/exact_match_LO_HI and eval/token_accuracy_LO_HI as (sum, weight) for every band.

  correct [b, t] bool (True at padding), token_weights [b, t], example_weights [b], band_ids [b]. Every
  batch reports every band (weight 0 for the others), so the loop can sum them.
  """
  exact = jnp.all(correct, axis=-1).astype(jnp.float32)  # [b]
  metrics = {}
  for index, band in enumerate(bands):
    in_band = example_weights * (band_ids == index)  # [b]
    metrics[band_name(band)] = (jnp.sum(exact * in_band), jnp.sum(in_band))
    band_tokens = token_weights * in_band[:, None]  # [b, t]
    metrics[band_name(band, "token_accuracy")] = (jnp.sum(correct * band_tokens), jnp.sum(band_tokens))
  return metrics


@task_lib.register("algorithmic")
class AlgorithmicTask(task_lib.Task):
  """Copy or reverse random strings; exact match per length band (see the module docstring)."""
  position_encodings = staticmethod(translator_lib.position_encodings)

  @classmethod
  def validate(cls, config, mode="train"):
    task = config.task
    validation.require_choice(config, "task.operation", algorithmic.OPERATIONS)
    validation.require_choice(config, "model.name", ("translator",))
    validation.require_positive(config, "task.min_length", "task.train_max_length", "task.num_eval_examples",
                                "model.d_model", "model.num_heads", "model.num_layers", "model.mlp_dim")
    if not validation.is_number(task.num_symbols) or not 2 <= task.num_symbols <= len(LETTERS):
      raise validation.ConfigError("task.num_symbols", task.num_symbols, f"must be in [2, {len(LETTERS)}]")
    if task.min_length > task.train_max_length:
      raise validation.ConfigError("task.min_length", task.min_length,
                                   f"must be <= task.train_max_length={task.train_max_length}")
    longest = cls.positions_needed(config)  # EOS included
    randomized = config.model.get("randomized_positions_max", 0)
    if randomized and randomized < longest:
      raise validation.ConfigError("model.randomized_positions_max", randomized,
                                   f"must be >= {longest}, the longest sequence the model sees (the longest "
                                   "eval band plus EOS), or 0 = off")

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    self.bands = parse_bands(config.task.eval_bands)
    # Positions 0 .. longest string (its EOS included) must have a row in a learned table.
    self.max_length = positions_for(config, workdir, mode, self.positions_needed)

  @staticmethod
  def positions_needed(config) -> int:
    """Positions of the longest string (its EOS included) a config trains or evaluates on (a ConfigDict or a
    recorded config's dict)."""
    task = config["task"]
    return max(task["train_max_length"], *(hi for _, hi in parse_bands(task["eval_bands"]))) + 1

  def make_model(self, rngs, *, dtype, param_dtype):
    c = self.config.model
    side = translator_lib.StackSize(c.d_model, c.num_heads, c.num_layers, c.mlp_dim)
    rope_scaling = dict(rope_scaling=c.rope_scaling, rope_scaling_factor=c.rope_scaling_factor) \
        if c.rope_scaling else {}
    randomized = translator_lib.RandomizedPositions(max_position=c.get("randomized_positions_max", 0),
                                                    at_eval=c.get("randomized_positions_at_eval", False))
    return translator_lib.Translator(
        algorithmic.vocab_size(self.config.task.num_symbols), encoder=side, decoder=side,
        position_encoding=c.position_encoding, max_length=self.max_length, randomized_positions=randomized,
        scan_layers=c.scan_layers, remat=c.get("remat", "none"),  # a run recorded before the two fields has neither
        implementation=c.get("implementation", "") or None, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        **rope_scaling)

  def _examples(self, rng, count, min_length, max_length, width):
    task = self.config.task
    return algorithmic.make_examples(rng, count, operation=task.operation, min_length=min_length,
                                     max_length=max_length, num_symbols=task.num_symbols, width=width)

  def train_batch(self, step, *, process_index, process_count):
    task, size = self.config.task, self.config.batch_size // process_count
    rng = np.random.default_rng([self.config.seed, _TRAIN_STREAM, step])
    batch = self._examples(rng, self.config.batch_size, task.min_length, task.train_max_length,
                           task.train_max_length)
    del batch["lengths"]
    return {k: v[process_index * size:(process_index + 1) * size] for k, v in batch.items()}

  def _token_losses(self, model, batch, position_rng=None):
    logits = model(batch["inputs"], batch["decoder_inputs"], position_rng=position_rng)  # [b, t, vocab]
    token_weights = (batch["targets"] != algorithmic.PAD_ID).astype(jnp.float32)  # [b, t]
    if "weights" in batch:
      token_weights = token_weights * batch["weights"][:, None]
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["targets"], token_weights,
                                               self.config.task.label_smoothing)
    return logits, token_weights, loss_sum, weight_sum

  def loss_terms(self, model, batch, *, rngs):
    # The model has no dropout (the sweep compares encodings, not regularisers); the step's rngs
    # draw its randomized positions, if the model has them (a pure function of (seed, step)).
    _, _, loss_sum, weight_sum = self._token_losses(model, batch, position_rng=rngs.positions())
    return loss_sum, weight_sum, {}

  def eval_batches(self, *, process_index, process_count):
    """Each band's examples in batches of eval_batch_size padded to the band's width (weight-0 rows fill up)."""
    for index, (lo, hi) in enumerate(self.bands):
      rng = np.random.default_rng([self.config.seed, _EVAL_STREAM, index])
      examples = self._examples(rng, self.config.task.num_eval_examples, lo, hi, hi)
      del examples["lengths"]
      examples["weights"] = np.ones(len(examples["inputs"]), np.float32)
      examples["band"] = np.full(len(examples["inputs"]), index, np.int32)
      yield from padded_batches(examples, self.config.eval_batch_size, process_index=process_index,
                                process_count=process_count)

  def eval_metrics(self, model, batch):
    logits, token_weights, loss_sum, weight_sum = self._token_losses(model, batch)
    correct = (jnp.argmax(logits, axis=-1) == batch["targets"]) | (token_weights == 0)  # [b, t]
    metrics = {"loss": (loss_sum, weight_sum), "token_accuracy": (jnp.sum(correct * token_weights), weight_sum)}
    metrics.update(band_metrics(self.bands, correct, token_weights, batch["weights"], batch["band"]))
    return metrics

  def infer_lines(self, model, lines):
    """Each line of letters (one symbol each) copied or reversed by greedy decoding."""
    num_symbols = self.config.task.num_symbols
    def symbol_ids(index, line):
      text = line.strip()
      if not text or len(text) >= self.max_length or any(ch not in LETTERS[:num_symbols] for ch in text):
        raise ValueError(f"needs 1 to {self.max_length - 1} letters from {LETTERS[:num_symbols]!r}, got {text!r}")
      return [algorithmic.FIRST_SYMBOL + LETTERS.index(ch) for ch in text]
    rows = task_lib.read_each(lines, symbol_ids)
    inputs = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for row, ids in zip(inputs, rows):
      row[:len(ids)] = ids
    generate = nnx.jit(decoding.generate, static_argnames=("max_length", "bos_id", "eos_id"))
    outputs = np.asarray(generate(model, inputs, max_length=self.max_length, bos_id=algorithmic.BOS_ID,
                                  eos_id=algorithmic.EOS_ID))
    return ["".join(LETTERS[i - algorithmic.FIRST_SYMBOL] for i in row if i >= algorithmic.FIRST_SYMBOL)
            for row in outputs]
