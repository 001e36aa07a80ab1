"""The template task: reverse strings of lowercase letters with a small bidirectional transformer.

Copy this file to start a task (and `configs/template.py` for its config), give `@task_lib.register` your name,
and add that name and module to `TASK_MODULES` in `xattn_jax/training/task.py`, or set `task.name` to
"package.module:YourTask". It is built from the real parts (`xattn_jax.layers` blocks, a position encoding from
the registry in `layers/positions.py`, `layer_stack` for the depth); the loop does the rest. Each method says what
the Task contract (`xattn_jax.training.task`) asks of it.

Tokens: 0 = padding, 1..26 = 'a'..'z'. An example of length n (padded to task.max_length) has
targets[i] = inputs[n - 1 - i] for i < n and 0 after: every position is tagged in one forward pass.
"""
from __future__ import annotations

import string

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax.layers import EncoderBlock, dense, layer_stack, make_position_encoding
from xattn_jax.layers import positions as position_layers
from xattn_jax.ops import masks
from xattn_jax.training import optim, task as task_lib, validation

ALPHABET = string.ascii_lowercase
VOCAB_SIZE = len(ALPHABET) + 1
MODELS = ("reverser",)
_TRAIN_STREAM, _EVAL_STREAM = 0, 1  # seeds of the train batches and of the eval set never collide


class Reverser(nnx.Module):
  """Embedding + position encoding -> stacked EncoderBlocks -> LayerNorm -> logits [b, t, vocab]."""

  def __init__(self, c, max_length: int, *, dtype, param_dtype, rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype)
    self.scan_layers, self.remat = c.scan_layers, c.remat
    self.multimodal_positions = "multimodal" in position_layers.get(c.position_encoding).layouts
    # Logical axis names ("vocab", "embed", ...) tell the loop how to shard each parameter.
    init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"), eager_sharding=False)
    self.embed = nnx.Embed(VOCAB_SIZE, c.d_model, embedding_init=init, rngs=rngs, **common)
    # Additive encodings add themselves to the embeddings; rotary ones hand the blocks a RotarySpec.
    self.positions = make_position_encoding(
        c.position_encoding, features=c.d_model, max_length=max_length, head_dim=c.d_model // c.num_heads,
        num_heads=c.num_heads,
        rotary_dim=c.rotary_dim or None, mrope_sections=tuple(c.mrope_sections) or None, rngs=rngs, **common)
    self.blocks = layer_stack.create_stack(  # num_layers blocks as one module, parameters [layers, ...]
        lambda r: EncoderBlock(c.d_model, c.num_heads, c.mlp_dim, dropout_rate=c.dropout_rate,
                               rotary=self.positions.rotary, rngs=r, **common), c.num_layers, rngs)
    self.final_norm = nnx.LayerNorm(c.d_model, rngs=rngs, **common)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"), eager_sharding=False)
    self.logits = dense.Dense(c.d_model, VOCAB_SIZE, kernel_init=init, rngs=rngs, **common)

  def __call__(self, tokens, *, deterministic: bool = True):
    """tokens [b, t] int (0 = padding) -> logits [b, t, vocab]; dropout only when not deterministic."""
    positions, _ = self.positions.sequence_positions(*tokens.shape)  # [b or 1, t]: 0..t-1
    x = self.positions.add_to_inputs(self.embed(tokens), positions)  # [b, t, d_model] (additive encodings)
    bias = self.positions.attention_bias(positions, positions)  # [b, heads, t, t] (ALiBi, T5) or None
    rotary_positions = jnp.broadcast_to(positions, (3, *tokens.shape)) if self.multimodal_positions else positions
    x = layer_stack.apply_stack(self.blocks, x, scan=self.scan_layers, remat=self.remat,
                                mask=masks.padding_mask(tokens != 0),  # [b, 1, 1, t]: keys that are letters
                                positions=rotary_positions, bias=bias, deterministic=deterministic)
    return self.logits(self.final_norm(x))


@task_lib.register("template")
class TemplateTask(task_lib.Task):
  """Reverse random letter strings (see the module docstring)."""

  @staticmethod
  def position_encodings():
    # What validation accepts (and names) for model.position_encoding, read from the registry when it runs (so
    # encodings registered since count): text takes the sequence encodings, and M-RoPE with every axis the token
    # index (text-only M-RoPE is 1D RoPE).
    return position_layers.names(layout=("sequence", "multimodal"))

  @classmethod
  def validate(cls, config, mode="train"):
    # Every task field, before anything is built: one ConfigError naming the field. The shared fields
    # (and d_model / num_heads / rotary dims) are checked by validation.validate_config.
    validation.require_choice(config, "model.name", MODELS)
    validation.require_positive(config, "model.num_layers", "model.mlp_dim", "task.min_length",
                                "task.max_length", "task.num_eval_examples")
    if config.task.min_length > config.task.max_length:
      raise validation.ConfigError("task.min_length", config.task.min_length,
                                   f"must be <= task.max_length={config.task.max_length}")

  def make_model(self, rngs, *, dtype, param_dtype):
    # An nnx.Module; `rngs` has the `params` and `dropout` streams (the loop reseeds dropout per step).
    return Reverser(self.config.model, self.config.task.max_length, dtype=dtype, param_dtype=param_dtype,
                    rngs=rngs)

  def _examples(self, stream: int, index: int, count: int) -> dict[str, np.ndarray]:
    """`count` random examples, a pure function of (seed, stream, index): resume is exact."""
    task = self.config.task
    rng = np.random.default_rng([self.config.seed, stream, index])
    lengths = rng.integers(task.min_length, task.max_length + 1, size=count)
    valid = np.arange(task.max_length)[None, :] < lengths[:, None]  # [count, max_length]
    inputs = np.where(valid, rng.integers(1, VOCAB_SIZE, size=valid.shape), 0).astype(np.int32)
    source = np.clip(lengths[:, None] - 1 - np.arange(task.max_length)[None, :], 0, None)  # i <- n - 1 - i
    targets = np.where(valid, np.take_along_axis(inputs, source, axis=1), 0).astype(np.int32)
    return {"inputs": inputs, "targets": targets, "weights": np.ones(count, np.float32)}

  def train_batch(self, step, *, process_index, process_count):
    # This process's rows of global batch `step`: numpy arrays with the batch on axis 0.
    size = self.config.batch_size // process_count
    batch = self._examples(_TRAIN_STREAM, step, self.config.batch_size)
    return {k: v[process_index * size:(process_index + 1) * size] for k, v in batch.items()}

  def _token_losses(self, model, batch, deterministic=True):
    logits = model(batch["inputs"], deterministic=deterministic)  # [b, t, vocab]
    token_weights = (batch["targets"] != 0) * batch["weights"][:, None]  # [b, t]
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["targets"], token_weights,
                                               self.config.task.label_smoothing)
    return logits, token_weights, loss_sum, weight_sum

  def loss_terms(self, model, batch, *, rngs):
    # Traced: the summed token loss, the token count and other train/<name> metrics as {name: (sum,
    # weight)}; Task.loss logs loss_sum / weight_sum as train/loss and each aux sum / weight, and
    # config.num_microbatches adds them all up over microbatches first.
    del rngs  # dropout draws from the model's own streams, reseeded by the loop each step
    logits, token_weights, loss_sum, weight_sum = self._token_losses(model, batch, deterministic=False)
    correct = jnp.sum((jnp.argmax(logits, axis=-1) == batch["targets"]) * token_weights)
    return loss_sum, weight_sum, {"token_accuracy": (correct, weight_sum)}

  def eval_batches(self, *, process_index, process_count):
    # Every eval example once, in batches of eval_batch_size; the last padded with weight-0 rows.
    total, size = self.config.task.num_eval_examples, self.config.eval_batch_size
    examples, local = self._examples(_EVAL_STREAM, 0, total), size // process_count
    for start in range(0, total, size):
      chunk = {k: v[start:start + size] for k, v in examples.items()}
      pad = size - len(chunk["weights"])
      batch = {k: np.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)) for k, v in chunk.items()}
      yield {k: v[process_index * local:(process_index + 1) * local] for k, v in batch.items()}

  def eval_metrics(self, model, batch):
    # Traced: {name: (sum, weight)}; the loop logs eval/<name> = total sum / total weight.
    logits, token_weights, loss_sum, weight_sum = self._token_losses(model, batch)
    correct = (jnp.argmax(logits, axis=-1) == batch["targets"]) | (token_weights == 0)  # [b, t]
    return {"loss": (loss_sum, weight_sum), "token_accuracy": (jnp.sum(correct * token_weights), weight_sum),
            "exact_match": (jnp.sum(jnp.all(correct, axis=-1) * batch["weights"]), jnp.sum(batch["weights"]))}

  def infer_lines(self, model, lines):
    """One output line per input line: the letters reversed by the model (`Task.infer`, what the launcher and a
    notebook call, hands on the non-blank lines)."""
    max_length = self.config.task.max_length
    def ids(index, line):
      text = line.strip()
      if not text or len(text) > max_length or any(ch not in ALPHABET for ch in text):
        # read_each names every such line; the launcher adds the input file's name and line numbers
        raise ValueError(f"template input {text!r}: needs 1 to {max_length} letters a-z")
      return [ALPHABET.index(ch) + 1 for ch in text]
    inputs = np.zeros((len(lines), max_length), np.int32)
    for row, line_ids in enumerate(task_lib.read_each(lines, ids)):
      inputs[row, :len(line_ids)] = line_ids
    predictions = np.asarray(jnp.argmax(nnx.jit(lambda m, x: m(x))(model, inputs), axis=-1))
    return ["".join(ALPHABET[i - 1] for i in pred[:np.count_nonzero(ids)] if i > 0)
            for pred, ids in zip(predictions, inputs)]
