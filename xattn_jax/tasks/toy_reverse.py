"""Toy task: reverse strings of lowercase letters with a tiny bidirectional transformer.

Tokens: 0 = padding, 1..26 = 'a'..'z'. An example of length n (padded to task.max_length) has
targets[i] = inputs[n - 1 - i] for i < n and 0 after. The model tags every position at once, so
inference is one forward pass. Small enough to train in seconds: the template and test bed for the
training loop.
"""
from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax.layers import dense
from xattn_jax.ops import attention as attention_ops
from xattn_jax.ops import masks as masks_lib
from xattn_jax.ops import positions as positions_lib
from xattn_jax.layers import layer_stack
from xattn_jax.training import optim, task as task_lib, validation

ALPHABET = string.ascii_lowercase
VOCAB_SIZE = len(ALPHABET) + 1
POSITION_ENCODINGS = ("none", "learned", "sinusoidal", "rope", "mrope")
MODELS = ("reverser",)
_TRAIN_STREAM, _EVAL_STREAM = 0, 1


def _init(names, init=nnx.initializers.lecun_normal()):
  return nnx.with_partitioning(init, names)


class ReverserBlock(nnx.Module):
  """Pre-LayerNorm bidirectional self-attention + MLP, each with a residual."""

  def __init__(self, d_model, num_heads, mlp_dim, *, position_encoding, rotary_dim, mrope_sections,
               dropout_rate, dtype, param_dtype, rngs):
    def linear(n_in, n_out, names):
      return dense.Dense(n_in, n_out, kernel_init=_init(names), dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)

    self.num_heads = num_heads
    self.position_encoding = position_encoding
    self.rotary_dim = rotary_dim or None  # None: the whole head_dim
    self.mrope_sections = tuple(mrope_sections)
    self.attention_norm = nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.query = linear(d_model, d_model, ("embed", "heads"))
    self.key = linear(d_model, d_model, ("embed", "heads"))
    self.value = linear(d_model, d_model, ("embed", "heads"))
    self.out = linear(d_model, d_model, ("heads", "embed"))
    self.mlp_norm = nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mlp_in = linear(d_model, mlp_dim, ("embed", "mlp"))
    self.mlp_out = linear(mlp_dim, d_model, ("mlp", "embed"))
    # One stream per residual branch, forked from the loop's `dropout` stream.
    self.attention_dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    self.mlp_dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def _heads(self, x):
    b, t, d = x.shape
    return x.reshape(b, t, self.num_heads, d // self.num_heads)  # -> [b, t, heads, head_dim]

  def _rotate(self, x, positions):
    if self.position_encoding == "rope":
      return positions_lib.apply_rope(x, positions, rotary_dim=self.rotary_dim)
    if self.position_encoding == "mrope":
      # Text only: time, height and width positions all equal the token index.
      positions = jnp.broadcast_to(positions, (3,) + positions.shape)  # [3, b, t]
      return positions_lib.apply_mrope(x, positions, self.mrope_sections, rotary_dim=self.rotary_dim)
    return x

  def __call__(self, x, mask, positions, *, deterministic=True):
    """x [b, t, d_model], mask [b, 1, 1, t] (True = real token), positions [b, t] -> [b, t, d_model].

    Residual dropout on both branches unless deterministic.
    """
    h = self.attention_norm(x)
    q = self._rotate(self._heads(self.query(h)), positions)
    k = self._rotate(self._heads(self.key(h)), positions)
    v = self._heads(self.value(h))
    attended = attention_ops.dot_product_attention(q, k, v, mask=mask)  # [b, t, heads, head_dim]
    x = x + self.attention_dropout(self.out(attended.reshape(x.shape)), deterministic=deterministic)
    return x + self.mlp_dropout(self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x)))),
                                deterministic=deterministic)


class Reverser(nnx.Module):
  """Embedding + position encoding -> stacked ReverserBlocks -> LayerNorm -> logits [b, t, vocab]."""

  def __init__(self, model_config, max_length, *, dtype, param_dtype, rngs):
    c = model_config
    self.position_encoding = c.position_encoding
    self.scan_layers = c.scan_layers
    self.remat = c.remat
    self.dtype = dtype
    self.embed = nnx.Embed(VOCAB_SIZE, c.d_model, embedding_init=_init(("vocab", "embed"),
                                                                       nnx.initializers.normal(1.0)),
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if c.position_encoding == "learned":
      self.position_table = nnx.Param(_init(("length", "embed"), nnx.initializers.normal(0.02))(
          rngs.params(), (max_length, c.d_model), param_dtype))
    self.blocks = layer_stack.create_stack(
        lambda r: ReverserBlock(c.d_model, c.num_heads, c.mlp_dim, position_encoding=c.position_encoding,
                                rotary_dim=c.rotary_dim, mrope_sections=c.mrope_sections,
                                dropout_rate=c.dropout_rate, dtype=dtype, param_dtype=param_dtype, rngs=r),
        c.num_layers, rngs)
    self.final_norm = nnx.LayerNorm(c.d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.logits = dense.Dense(c.d_model, VOCAB_SIZE, kernel_init=_init(("embed", "vocab")),
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, tokens, *, deterministic=True):
    """tokens [b, t] int (0 = padding) -> logits [b, t, vocab]; dropout only when not deterministic."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = self.embed(tokens)  # [b, t, d_model]
    if self.position_encoding == "learned":
      x = x + self.position_table[...][:t].astype(x.dtype)
    elif self.position_encoding == "sinusoidal":
      x = x + positions_lib.sinusoidal(positions, x.shape[-1]).astype(x.dtype)
    mask = masks_lib.padding_mask(tokens != 0)  # [b, 1, 1, t]
    x = layer_stack.apply_stack(self.blocks, x, mask, positions, scan=self.scan_layers,
                                remat=self.remat, deterministic=deterministic)
    return self.logits(self.final_norm(x))


def encode(text: str, max_length: int) -> np.ndarray:
  if not text or any(ch not in ALPHABET for ch in text) or len(text) > max_length:
    raise ValueError(f"toy_reverse input {text!r}: needs 1 to {max_length} letters a-z")
  return np.array([ALPHABET.index(ch) + 1 for ch in text], np.int32)


def decode(ids) -> str:
  return "".join(ALPHABET[i - 1] for i in ids if i > 0)


@task_lib.register("toy_reverse")
class ToyReverseTask(task_lib.Task):
  """Reverse random letter strings (see the module docstring)."""

  @classmethod
  def validate(cls, config, mode="train"):
    validation.require_choice(config, "model.name", MODELS)
    validation.require_choice(config, "model.position_encoding", POSITION_ENCODINGS)
    validation.require_positive(config, "model.num_layers", "model.mlp_dim", "task.min_length",
                                "task.max_length", "task.num_eval_examples")
    if config.task.min_length > config.task.max_length:
      raise validation.ConfigError("task.min_length", config.task.min_length,
                                   f"must be <= task.max_length={config.task.max_length}")

  def make_model(self, rngs, *, dtype, param_dtype):
    return Reverser(self.config.model, self.config.task.max_length, dtype=dtype,
                    param_dtype=param_dtype, rngs=rngs)

  def _examples(self, stream: int, index: int, count: int) -> dict[str, np.ndarray]:
    """`count` random examples, a pure function of (seed, stream, index)."""
    task = self.config.task
    rng = np.random.default_rng([self.config.seed, stream, index])
    lengths = rng.integers(task.min_length, task.max_length + 1, size=count)
    letters = rng.integers(1, VOCAB_SIZE, size=(count, task.max_length), dtype=np.int32)
    valid = np.arange(task.max_length)[None, :] < lengths[:, None]  # [count, max_length]
    inputs = np.where(valid, letters, 0).astype(np.int32)
    # Position i of the target reads position n - 1 - i of the input.
    source_index = np.clip(lengths[:, None] - 1 - np.arange(task.max_length)[None, :], 0, None)
    targets = np.where(valid, np.take_along_axis(inputs, source_index, axis=1), 0).astype(np.int32)
    return {"inputs": inputs, "targets": targets, "weights": np.ones(count, np.float32)}

  def train_batch(self, step, *, process_index, process_count):
    size = self.config.batch_size // process_count
    batch = self._examples(_TRAIN_STREAM, step, self.config.batch_size)
    return {k: v[process_index * size:(process_index + 1) * size] for k, v in batch.items()}

  def _token_losses(self, model, batch, deterministic=True):
    logits = model(batch["inputs"], deterministic=deterministic)  # [b, t, vocab]
    token_weights = (batch["targets"] != 0) * batch["weights"][:, None]  # [b, t]
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["targets"], token_weights,
                                               self.config.task.label_smoothing)
    return logits, token_weights, loss_sum, weight_sum

  def loss(self, model, batch, *, rngs):
    del rngs  # dropout draws from the model's own streams, reseeded by the loop each step
    _, _, loss_sum, weight_sum = self._token_losses(model, batch, deterministic=False)
    return loss_sum / jnp.maximum(weight_sum, 1.0), {}

  def eval_batches(self, *, process_index, process_count):
    total = self.config.task.num_eval_examples
    size = self.config.eval_batch_size
    examples = self._examples(_EVAL_STREAM, 0, total)
    local = size // process_count
    for start in range(0, total, size):
      batch = {}
      for key, array in examples.items():
        chunk = array[start:start + size]
        pad = [(0, size - len(chunk))] + [(0, 0)] * (array.ndim - 1)
        batch[key] = np.pad(chunk, pad)  # padded rows have weight 0
      yield {k: v[process_index * local:(process_index + 1) * local] for k, v in batch.items()}

  def eval_metrics(self, model, batch):
    logits, token_weights, loss_sum, weight_sum = self._token_losses(model, batch)
    correct = (jnp.argmax(logits, axis=-1) == batch["targets"]) | (token_weights == 0)  # [b, t]
    return {
        "loss": (loss_sum, weight_sum),
        "token_accuracy": (jnp.sum(correct * token_weights), weight_sum),
        "exact_match": (jnp.sum(jnp.all(correct, axis=-1) * batch["weights"]), jnp.sum(batch["weights"])),
    }

  def infer(self, model, lines):
    """Each line (letters a-z) reversed by the model."""
    max_length = self.config.task.max_length
    inputs = np.zeros((len(lines), max_length), np.int32)
    for row, line in enumerate(lines):
      try:
        ids = encode(line.strip(), max_length)
      except ValueError as e:
        raise task_lib.InputLineError(row, str(e)) from None
      inputs[row, :len(ids)] = ids
    predictions = np.asarray(jnp.argmax(nnx.jit(lambda m, x: m(x))(model, inputs), axis=-1))
    return [decode(pred[:np.count_nonzero(ids)]) for pred, ids in zip(predictions, inputs)]
