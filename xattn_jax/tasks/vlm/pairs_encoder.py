"""An image encoder for a user's image-caption pairs: a ViT trained on the pairs' own images to name the words
of each image's caption (`configs/vlm_encoder.py:data=pairs`, task "vlm_pairs_encoder").

The digits' encoder (`encoder.py`) reads digit strips on an 8 x 32 grey canvas; a user's pictures need an
encoder that has seen them, at a canvas that keeps them legible. This one learns from the pairs alone, as
weakly supervised pretraining from captions does (predict the caption's words from the image; Joulin et al.,
2016; with runs of adjacent words, Li et al., 2017): the ViT's mean patch token goes through its head to one
logit per term of the vocabulary, trained with a sigmoid cross-entropy per term against whether the caption
holds it. Terms are the captions' words (`caption_words`: runs of letters and digits, lower-cased, each
character of Chinese or Japanese) and their runs of 2 to data.ngrams adjacent words, which keep what a bag of
words loses, the order ("a square left of a cross" against "a cross left of a square"); the vocabulary is the
data.vocab_size terms in the most training captions; the head's bias starts at each term's log-odds in the
training captions (`prior_logits`). A VLM that freezes it (configs/vlm_tsv.py, the default there) reads its patch features.

Images come from data.train_file / data.eval_file (`image_path<TAB>text`, data.image_text: grey, or RGB with
data.color, ink high, fitted top-left into the canvas data.canvas "HxW"); every bad line stops the run before anything is written,
naming file and line. Training pairs are shuffled every epoch (under config.seed), each once an epoch.
Metrics, logged as eval/<name> on the eval pairs:
  loss             the sigmoid cross-entropy summed over the vocabulary, per image
  word_f1          micro F1 of the terms predicted (probability > 0.5) against the caption's
  word_precision   share of the predicted terms that the caption holds
  word_recall      share of the caption's vocabulary terms that are predicted
Inference (`--mode=infer`): each line names an image file; the output is the name, a tab and the predicted
terms, most probable first, separated by " | ".
"""
from __future__ import annotations

import collections
import functools
import re
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xattn_jax.data import batching, image_text, vlm_digits
from xattn_jax.tasks.vlm import encoder as encoder_lib
from xattn_jax.training import task as task_lib, validation

EVAL_METRICS = ("eval/loss", "eval/word_f1", "eval/word_precision", "eval/word_recall")
# Scripts written without spaces between words (Han, hiragana, katakana): each character is a word, and runs of
# two (data.ngrams) stand for the words of two characters; a Chinese caption was one term, shared by no other.
_UNSPACED = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def caption_words(text: str) -> list[str]:
  """The words of a caption, lower-cased and in NFC, in order: runs of letters and digits with the marks that
  combine with them (a Devanagari vowel sign; `\\w+` split "हिन्दी" into "ह", "न", "द"), and each character of a
  script written without spaces (`_UNSPACED`)."""
  words, word = [], ""
  for char in unicodedata.normalize("NFC", text).lower():
    if _UNSPACED.match(char):
      words += [word, char] if word else [char]
      word = ""
    elif char.isalnum() or char == "_" or (word and unicodedata.category(char).startswith("M")):
      word += char
    elif word:
      words.append(word)
      word = ""
  return words + [word] if word else words


def caption_terms(text: str, ngrams: int) -> set[str]:
  """The caption's words and its runs of 2..ngrams adjacent words ("square left"): the runs carry the
  order that a bag of words loses ("a square left of a cross" against "a cross left of a square")."""
  words = caption_words(text)
  return {" ".join(words[i:i + n]) for n in range(1, ngrams + 1) for i in range(len(words) - n + 1)}


def vocabulary(texts, size: int, ngrams: int = 1) -> tuple[str, ...]:
  """The `size` terms (`caption_terms`) in the most captions (ties alphabetical)."""
  counts = collections.Counter(term for text in texts for term in caption_terms(text, ngrams))
  return tuple(sorted(counts, key=lambda term: (-counts[term], term))[:size])


def word_targets(texts, words: tuple[str, ...], size: int, ngrams: int = 1) -> np.ndarray:
  """[n, size] float32: 1 where the caption holds the vocabulary term (columns past len(words) stay 0)."""
  index = {word: i for i, word in enumerate(words)}
  targets = np.zeros((len(texts), size), np.float32)
  for row, text in enumerate(texts):
    for term in caption_terms(text, ngrams):
      if term in index:
        targets[row, index[term]] = 1.0
  return targets


def prior_logits(texts, words: tuple[str, ...], size: int, ngrams: int = 1) -> np.ndarray:
  """[size] float32: each term's log-odds of appearing in a training caption (the head's initial bias), so
  training starts at the words' frequencies instead of one half each: with a vocabulary much larger than a
  caption, the loss is otherwise spent first on pushing every absent word down (RetinaNet's prior init).
  Columns past len(words), never a target, start at a probability of 1e-4."""
  frequency = word_targets(texts, words, size, ngrams).mean(axis=0)
  probability = np.where(np.arange(size) < len(words), np.clip(frequency, 1e-4, 1 - 1e-4), 1e-4)
  return np.log(probability / (1 - probability)).astype(np.float32)


@task_lib.register("vlm_pairs_encoder")
class CaptionWordsEncoderTask(task_lib.Task):
  """Name the words of each image's caption (see the module docstring)."""
  eval_metric_names = EVAL_METRICS

  @classmethod
  def validate(cls, config, mode="train"):
    validation.require_choice(config, "model.name", ("vit",))
    validation.require_positive(config, "model.d_model", "model.num_heads", "model.num_blocks", "model.mlp_ratio",
                                "model.patch_size", "data.vocab_size")
    if "ngrams" in config.data:  # absent from runs made before it: words alone
      validation.require_positive(config, "data.ngrams")
    if "color" in config.data:  # absent from runs made before it: grey
      validation.require_choice(config, "data.color", (True, False))
    height, width = encoder_lib.canvas(config)  # a malformed data.canvas is named there
    patch = config.model.patch_size
    if height % patch or width % patch:
      raise validation.ConfigError("model.patch_size", patch, f"must divide both sides of data.canvas "
                                   f"{config.data.canvas!r}")
    encoder_lib.check_grid(config)
    channels = 1 if encoder_lib.grey(config) else 3
    if config.model.get("channels", 1) != channels:
      raise validation.ConfigError("model.channels", config.model.get("channels", 1),
                                   f"must be {channels} with data.color={not encoder_lib.grey(config)}")
    if config.model.num_classes != config.data.vocab_size:
      raise validation.ConfigError("model.num_classes", config.model.num_classes,
                                   f"must be data.vocab_size, {config.data.vocab_size} (one logit per word)")
    for field in ("data.train_file",) + (("data.eval_file",) if mode != "infer" else ()):
      encoder_lib.read_pairs_field(config, field)

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    self.canvas = encoder_lib.canvas(config)
    self.size = config.data.vocab_size
    train = encoder_lib.read_pairs_field(config, "data.train_file")  # the vocabulary is the training captions' words
    self.ngrams = config.data.get("ngrams", 1)
    self.words = vocabulary([example.targets()[0] for example in train], self.size, self.ngrams)
    self._train = train if mode == "train" else None
    self._eval = None

  # --- data -------------------------------------------------------------------------------------

  def _arrays(self, examples):
    images = vlm_digits.collate_images([example.images for example in examples], canvas=self.canvas,
                                       max_images=1)["images"][:, 0]
    return images, word_targets([example.targets()[0] for example in examples], self.words, self.size, self.ngrams)

  def steps_per_epoch(self):
    return batching.steps_per_epoch(len(self._train), self.config.batch_size)

  def train_batch(self, step, *, process_index, process_count):
    count = len(self._train)
    local = self.config.batch_size // process_count
    positions = step * self.config.batch_size + process_index * local + np.arange(local)  # across epochs
    epochs, offsets = np.divmod(positions, count)
    orders = {int(e): np.random.default_rng([self.config.seed, int(e)]).permutation(count) for e in set(epochs)}
    images, targets = self._arrays([self._train[orders[int(e)][o]] for e, o in zip(epochs, offsets)])
    return {"images": images, "targets": targets}

  def eval_set(self):
    if self._eval is None:
      self._eval = self._arrays(encoder_lib.read_pairs_field(self.config, "data.eval_file"))
    return self._eval

  def eval_batches(self, *, process_index, process_count):
    images, targets = self.eval_set()
    return encoder_lib.padded_eval_batches(images, {"targets": targets}, self.config.eval_batch_size,
                                           process_index, process_count)

  # --- model, loss, metrics ---------------------------------------------------------------------

  def make_model(self, rngs, *, dtype, param_dtype):
    model = encoder_lib.make_encoder(self.config.model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if self._train is not None:  # (eval and infer restore the trained bias)
      bias = prior_logits([example.targets()[0] for example in self._train], self.words, self.size, self.ngrams)
      model.head.bias.value = jnp.asarray(bias, model.head.bias.value.dtype)
    return model

  @staticmethod
  def _logits(model, images):
    return model(images)  # [b, vocab]: the head on the mean patch token (pool="gap"), float32

  def loss_terms(self, model, batch, *, rngs):
    del rngs  # no dropout
    per_image = optax.sigmoid_binary_cross_entropy(self._logits(model, batch["images"]), batch["targets"]).sum(-1)
    return jnp.sum(per_image), jnp.float32(per_image.shape[0]), {}

  def eval_metrics(self, model, batch):
    """Sums over the eval pairs (see the module docstring)."""
    logits, targets, weights = self._logits(model, batch["images"]), batch["targets"], batch["weights"]
    per_image = optax.sigmoid_binary_cross_entropy(logits, targets).sum(-1)
    predicted = (logits > 0).astype(jnp.float32) * weights[:, None]
    truth = targets * weights[:, None]
    hits = jnp.sum(predicted * truth)
    return {"loss": (jnp.sum(per_image * weights), jnp.sum(weights)),
            "word_f1": (2 * hits, jnp.sum(predicted) + jnp.sum(truth)),
            "word_precision": (hits, jnp.sum(predicted)),
            "word_recall": (hits, jnp.sum(truth))}

  # --- inference --------------------------------------------------------------------------------

  @functools.cached_property
  def _probabilities(self):
    return nnx.jit(lambda model, images: jax.nn.sigmoid(self._logits(model, images)))

  def infer_lines(self, model, lines):
    images = task_lib.read_each(lines, lambda index, line: image_text.load_image(
        self.input_path(line.strip()), self.canvas, grey=encoder_lib.grey(self.config)))
    batch = vlm_digits.collate_images([(image,) for image in images], canvas=self.canvas, max_images=1)
    probabilities = np.asarray(self._probabilities(model, batch["images"][:, 0]))[:, :len(self.words)]
    outputs = []
    for line, row in zip(lines, probabilities):
      order = [i for i in np.argsort(-row, kind="stable") if row[i] > 0.5]
      outputs.append(f"{line.strip()}\t{' | '.join(self.words[i] for i in order) or '(none)'}")
    return outputs
