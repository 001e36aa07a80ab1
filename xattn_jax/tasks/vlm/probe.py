"""The ceiling of the digit VLMs: a small probe trained on the frozen encoder's features reads each strip's digits,
and the answers follow from what it reads.

    encoder = load_encoder("workdirs/vlm_encoder")                  # the frozen encoder of a finished run
    probe, seconds = train_probe(encoder, max_digits=4, steps=600)
    metrics = probe_metrics(encoder, examples, max_digits=4, probe=probe)  # exact_match, by digits, by kind
    head = probe_metrics(encoder, examples, max_digits=4)                  # the encoder's own head reading
    direct, _ = train_probe(encoder, max_digits=4, steps=3500, direct_sum=True)  # the sum learned: more steps

`StripProbe`: one learned query per strip position reads the features (the encoder's `features`, frozen, the
canvas padding included, as the VLM reads them) through the probe's own learned 2D position table in one
cross-attention block; a linear head names the digit there or EMPTY. It is trained on freshly drawn "train"
strips (`data.vlm_digits.draw_strip`), never on a test image. Its answers to an example's targets are the
ones its reading implies (`answers`): the caption is the digits read, the count how many, the n-th digit the
n-th read, the sum their sum; "which is larger ?" is read from the two captions that the prompt already
holds (the VLM's eval gives it the reference captions before that target), so it is always right, as it can
be for the connectors. Exact match over the same targets as the VLM's eval is then the share a model that
reads the features as well as this probe could reach. The same scoring of the encoder's own position head
(trained with the encoder; a linear read of each position's mean patch feature) is the other reference.

The sum is the one answer a reading gets by arithmetic the connectors must learn. `direct_sum=True` adds a
head that predicts it from the positions' states (trained jointly on the same strips), and its prediction
answers the sum question (`Reading.total`): the probe that predicts the answers directly.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xattn_jax.data import vlm_digits
from xattn_jax.layers import blocks, dense, make_position_encoding
from xattn_jax.models import latent_reader
from xattn_jax.tasks.vlm import encoder as encoder_task


class StripProbe(nnx.Module):
  """features [b, 1 + P, w] of the patch grid `grid` -> logits [b, max_digits, NUM_POSITION_CLASSES] (float32).

  With `direct_sum`, a second head predicts the digits' sum directly (`logits`' second output: an MLP on the
  positions' states, classes 0 .. 9 * max_digits), so the sum is learned from the features as the VLMs must
  learn it, not added up from the digits read.
  """

  def __init__(self, feature_width: int, grid: tuple[int, int], max_digits: int, *, num_heads: int = 4,
               direct_sum: bool = False, rngs: nnx.Rngs):
    self.grid = tuple(grid)
    self.positions = make_position_encoding("learned_2d", features=feature_width, grid=self.grid,
                                            num_extra_tokens=1, rngs=rngs)
    self.queries = latent_reader.LearnedQueries(max_digits, feature_width, rngs=rngs)
    self.block = latent_reader.ReaderBlock(feature_width, feature_width, num_heads, 2 * feature_width, rngs=rngs)
    self.norm = blocks.layer_norm(feature_width, rngs=rngs)
    self.head = dense.Dense(feature_width, vlm_digits.NUM_POSITION_CLASSES, rngs=rngs)
    self.sum_head = (blocks.MLP(max_digits * feature_width, 4 * feature_width, 9 * max_digits + 1, rngs=rngs)
                     if direct_sum else None)

  def __call__(self, features):
    return self.logits(features)[0]

  def logits(self, features):
    """-> (position logits [b, max_digits, NUM_POSITION_CLASSES], sum logits [b, 9 * max_digits + 1] or None)."""
    features = self.positions.add_to_inputs(features, grid=self.grid)
    states = self.norm(self.block(self.queries(features.shape[0], features.dtype), features))  # [b, max_digits, w]
    sums = None if self.sum_head is None else self.sum_head(states.reshape(states.shape[0], -1)).astype(jnp.float32)
    return self.head(states).astype(jnp.float32), sums


def _canvas_images(strips, canvas):
  return vlm_digits.collate_images([(s,) for s in strips], canvas=canvas, max_images=1)["images"][:, 0]


def train_probe(encoder, *, max_digits: int, scale: int = 1, steps: int = 600, batch_size: int = 64,
                learning_rate: float = 2e-3, seed: int = 0, direct_sum: bool = False) -> tuple[StripProbe, float]:
  """A StripProbe trained on the frozen `encoder`'s features of fresh "train" strips -> (probe, seconds).

  AdamW (weight decay 0.01), linear warmup over a tenth of the steps then cosine decay. With direct_sum the
  loss adds the sum head's cross-entropy to the positions'.
  """
  canvas = vlm_digits.canvas_for(max_digits, scale)
  patch = encoder.patch_size
  probe = StripProbe(encoder.width, (canvas[0] // patch, canvas[1] // patch), max_digits, direct_sum=direct_sum,
                     rngs=nnx.Rngs(seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(steps // 10, 1), steps)
  optimizer = nnx.Optimizer(probe, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)

  @nnx.jit
  def step(probe, optimizer, encoder, images, labels, sums):
    features = jax.lax.stop_gradient(encoder.features(images))
    def loss_fn(probe):
      positions, sum_logits = probe.logits(features)
      loss = optax.softmax_cross_entropy_with_integer_labels(positions, labels).mean()
      if sum_logits is not None:
        loss += optax.softmax_cross_entropy_with_integer_labels(sum_logits, sums).mean()
      return loss
    loss, grads = nnx.value_and_grad(loss_fn)(probe)
    optimizer.update(probe, grads)
    return loss

  rng = np.random.default_rng([seed, 7])
  start = time.perf_counter()
  for _ in range(steps):
    strips, sequences = zip(*(vlm_digits.draw_strip("train", rng, max_digits=max_digits, scale=scale)
                              for _ in range(batch_size)))
    step(probe, optimizer, encoder, jnp.asarray(_canvas_images(strips, canvas)),
         jnp.asarray(vlm_digits.position_labels(sequences, max_digits)), jnp.asarray([sum(s) for s in sequences]))
  return probe, time.perf_counter() - start


class Reading(tuple):
  """The digits read from one image, in order (a tuple), and `total`: the sum a direct-sum probe predicted, or
  None (the sum is then the digits' sum)."""

  def __new__(cls, digits, total: int | None = None):
    reading = super().__new__(cls, digits)
    reading.total = total
    return reading


def read_digits(encoder, images, *, max_digits: int, scale: int = 1, probe: StripProbe | None = None,
                batch_size: int = 128) -> list[Reading]:
  """Per image [h, w] (on the canvas of max_digits, scale) the digits read, up to the first EMPTY: by the
  probe, or with probe=None by the encoder's own position head (`encoder.position_logits`); with the total of
  the probe's sum head where it has one."""
  canvas = vlm_digits.canvas_for(max_digits, scale)
  width = vlm_digits.DIGIT_SIZE * scale
  if probe is None:
    predict = nnx.jit(lambda e, x: (
        jnp.argmax(encoder_task.position_logits(e, x, position_width=width), axis=-1), None))
  else:
    def predict_(e, x):
      positions, sums = probe.logits(e.features(x))
      return jnp.argmax(positions, axis=-1), None if sums is None else jnp.argmax(sums, axis=-1)
    predict = nnx.jit(predict_)
  reads = []
  for start in range(0, len(images), batch_size):
    rows, totals = predict(encoder, jnp.asarray(_canvas_images(images[start:start + batch_size], canvas)))
    rows = np.asarray(rows)
    totals = [None] * len(rows) if totals is None else [int(t) for t in np.asarray(totals)]
    for row, total in zip(rows, totals):
      stop = np.flatnonzero(row == vlm_digits.EMPTY)
      reads.append(Reading((int(d) for d in row[:stop[0] if len(stop) else len(row)]), total))
  return reads


def answers(example: vlm_digits.VLMExample, reads) -> list[str]:
  """The example's targets as its images' digit sequences `reads` imply them (see the module docstring)."""
  if example.kind == "caption":
    return [vlm_digits.digit_words(reads[0])]
  if example.kind == "count":
    return [vlm_digits.number_words(len(reads[0]))]
  if example.kind == "sum":
    total = getattr(reads[0], "total", None)
    return [vlm_digits.number_words(sum(reads[0]) if total is None else total)]
  if example.kind == "nth":
    question = next(value for role, value in example.segments if role == "text")
    position = next(i for i, word in enumerate(vlm_digits.ORDINALS) if f" {word} " in f" {question} ")
    return [vlm_digits.DIGIT_WORDS[reads[0][position]] if position < len(reads[0]) else ""]
  if example.kind == "larger":  # its last target follows from the reference captions the prompt holds
    return [vlm_digits.digit_words(reads[0]), vlm_digits.digit_words(reads[1]), example.targets()[-1]]
  raise ValueError(f"answers: no answers for kind {example.kind!r}; kinds: {tuple(vlm_digits.KINDS)}")


def answers_correct(examples, reads) -> list[bool]:
  """Per target of every example, in order (as the VLM's eval counts them): is the implied answer the reference."""
  return [answer == target for example, read in zip(examples, reads)
          for answer, target in zip(answers(example, read), example.targets())]


def load_encoder(workdir: str):
  """The ViT of a finished vlm_encoder run in workdir, with the weights a VLM freezing it reads (those of
  the checkpoint its run names as its result, `checkpoints.result_step`)."""
  from xattn_jax.training import checkpoints, workdir as workdir_lib
  model_config = workdir_lib.stored_config(workdir).model
  build = lambda: encoder_task.make_encoder(model_config, rngs=nnx.Rngs(params=0, dropout=0))
  encoder = build()
  state = nnx.state(encoder, nnx.Param)
  nnx.replace_by_pure_dict(state, checkpoints.restore_params(workdir, checkpoints.result_step(workdir), build))
  nnx.update(encoder, state)
  return encoder


def probe_metrics(encoder, examples, *, max_digits: int, scale: int = 1,
                  probe: StripProbe | None = None) -> dict[str, float]:
  """Exact match of the answers a reading implies (`read_digits`: the probe's, or the encoder head's) over every
  target of examples, overall, per largest-image digit count (exact_match_<k>digits) and per kind
  (exact_match_<kind>), grouped as the VLM's eval groups them."""
  images = [image for example in examples for image in example.images]
  reads = iter(read_digits(encoder, images, max_digits=max_digits, scale=scale, probe=probe))
  per_example = [[next(reads) for _ in example.images] for example in examples]
  correct = np.asarray(answers_correct(examples, per_example), float)
  kinds = np.array([e.kind for e in examples for _ in e.targets()])
  digits = np.array([e.num_digits for e in examples for _ in e.targets()])
  metrics = {"exact_match": float(correct.mean())}
  for kind in sorted(set(kinds)):
    metrics[f"exact_match_{kind}"] = float(correct[kinds == kind].mean())
  for n in sorted(set(digits.tolist())):
    metrics[f"exact_match_{n}digits"] = float(correct[digits == n].mean())
  return metrics
