"""Image-to-text with a frozen language model: `models.vlm.VisionLanguageModel` (`configs/vlm_digits.py`,
`configs/vlm_tsv.py`; task "vlm").

The frozen parts, the image encoder and the language model, are finished runs of their own (`frozen`: their
configs, records and weights); eval and infer read only this run's workdir.

Data (`data.source`, SOURCES):
  digits  the bundled strips of data.vlm_digits (data.kinds, data.max_digits, data.scale):
          data.num_train_examples "train" examples cycled as drawn, data.num_eval_examples of data.eval_split
          ("validation" while developing and choosing, "test" for the final score: `--mode=eval
          --config.data.eval_split=test`)
  tsv     a user's `image_path<TAB>text` files data.train_file / data.eval_file (data.image_text); every
          bad line stops the run before anything is written, naming file and line; the training pairs are
          shuffled every epoch
Images sit top-left on the encoder's canvas (`canvas`: data.canvas, else the strips' of data.max_digits and
data.scale), up to
MAX_IMAGES per example. A training batch has MAX_IMAGES image slots and rows of the longest example's tokens,
or with data.length_bucketing (either source) only as many slots and tokens (rounded up to 8) as its own
examples need: each epoch's examples (a permutation of them, under data.seed for the bundled strips and
config.seed for a user's pairs) are sorted by image count before they are cut into batches, which then come
in a random order, so nearly every batch holds examples of one image count. With data.cache_features the
frozen encoder reads every training image once, before the first step (`vlm.frozen_features`, as a step
would), and training batches carry those features in place of pixels: a step skips the encoder. Eval and
infer read pixels.

Token layout of an example: BOS, then its segments in order, then EOS. A text or target segment is its
SentencePiece ids (segments encoded one by one give the ids of the LM's pretraining text); an image is
`slots_per_image` SOFT_TOKEN slots (the connector's soft tokens; none for flamingo) and then the IMAGE_TOKEN
marker. The loss is on the target segments only: each target token, and after a target the token that ends
it (EOS, the next image's marker, or the next text's first token). With task.distill_weight W > 0 (the bundled
strips only) the loss adds W times `distillation.description_distillation`: the LM's residual stream after each
block (the first task.distill_blocks; 0: all) at every image marker and every text token after the first image,
against the same LM's on the example's text with each image described in words (`vlm_digits.described_text_of`),
computed once before training. Eval and infer generate each target in turn from the prefix before it (`answers`;
with task.describe_first, in two passes through the images' descriptions).

Metrics, logged as eval/<name>:
  loss, token_accuracy    cross-entropy / argmax accuracy per target token (the end token included)
  exact_match, chrf       generated target == reference (whitespace-normalised) / sacrebleu corpus chrF,
                          0-100 as the translator logs it, over every target of every eval example
  exact_match_<k>digits   exact match over the examples whose largest image has k digits (digits only)
  exact_match_<kind>      per kind of example (data.vlm_digits.KINDS, or "user")
Infer: each line is `image_path` (generate its caption), `image_path<TAB>question`, or two images and a question,
`a.png<TAB>b.png<TAB>which is larger ?` (the last tab field is the question): each image of two is followed by
the model's own caption of it, as the two-image examples are laid out (`answers.generate_in_turn`). The output is the
answer, or the caption (two images and an empty question: each image's caption alone, joined by " | "); with
task.describe_first, the frozen LM's answer from the images' descriptions.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from ml_collections import ConfigDict

from xattn_jax.data import batching, image_text, splits, tokenizers, vlm_digits
from xattn_jax.layers import positions as position_layers
from xattn_jax.models import connectors, lm as lm_lib, vlm
from xattn_jax.tasks import decoding_config
from xattn_jax.tasks.lm import text as lm_task
from xattn_jax.tasks.vlm import answers as answers_lib, distillation, encoder as encoder_task, frozen
from xattn_jax.training import optim, sharding, task as task_lib, validation
from xattn_jax.training.errors import RunError

SOURCES = ("digits", "tsv")
MAX_IMAGES = 2  # image slots per example: the two-image "larger" kind
EVAL_METRICS = ("eval/loss", "eval/token_accuracy", "eval/exact_match", "eval/chrf")
# data.cache_features holds the training images' frozen features in host memory up to this size; a larger
# training set runs the encoder in every step instead (logged).
FEATURE_CACHE_MAX_BYTES = 2 << 30


def canvas(config) -> tuple[int, int]:
  """The images' canvas: data.canvas ("HxW", a user's pairs read by an encoder trained on them), else the
  digit strips' of data.max_digits and data.scale; the frozen encoder's either way."""
  return encoder_task.canvas(config)


@dataclasses.dataclass(frozen=True)
class Layout:
  """One example as token arrays (see the module docstring): ids, labels (the token to predict at each
  position), weights (1 on target positions) and per target (prefix length, end token id, reference)."""
  ids: np.ndarray
  labels: np.ndarray
  weights: np.ndarray
  targets: tuple[tuple[int, int, str], ...]
  # task.distill_weight > 0 (training examples): the text with each image described in words instead of its
  # soft tokens, and for each position of ids the position of the same token there (-1: not distilled)
  teacher_ids: np.ndarray | None = None
  teacher_index: np.ndarray | None = None


@task_lib.register("vlm")
class VLMTask(task_lib.Task):
  """Generate the text of images through a connector into a frozen LM (see the module docstring)."""
  eval_metric_names = EVAL_METRICS

  # --- config -----------------------------------------------------------------------------------

  @classmethod
  def validate(cls, config, mode="train"):
    model, data = config.model, config.data
    validation.require_choice(config, "model.name", ("vlm",))
    validation.require_choice(config, "model.connector", connectors.CONNECTORS)
    validation.require_choice(config, "model.image_positions", vlm.IMAGE_POSITIONS)
    validation.require_choice(config, "model.feature_positions", connectors.feature_position_encodings())
    kind = connectors.CONNECTORS[model.connector]
    spatial = " or ".join(f"connector={name}" for name, k in connectors.CONNECTORS.items() if k.spatial)
    if model.image_positions == "mrope" and not kind.spatial:
      raise validation.ConfigError("model.image_positions", model.image_positions,
                                   f"'mrope' places soft tokens on their patch grid: {spatial} only, got "
                                   f"model.connector={model.connector!r}")
    validation.require_positive(config, "model.num_heads", "model.mlp_ratio", "model.cross_attention_every",
                                "model.resampler_blocks", "model.num_queries", "model.qformer_width",
                                "model.qformer_blocks", "model.qformer_cross_attention_every",
                                "model.spatial_merge", "data.max_digits", "data.scale", "task.decoding.max_new_tokens")
    validation.require_positive(config, "model.num_latents", allow_zero=True)
    if problem := kind.check_config(model):
      raise validation.ConfigError(*problem)
    distill = config.task.get("distill_weight", 0.0)
    if not validation.is_number(distill) or not 0 <= distill < float("inf"):
      raise validation.ConfigError("task.distill_weight", distill, "must be a finite number >= 0 (0: off)")
    if distill and data.source != "digits":
      raise validation.ConfigError("task.distill_weight", distill,
                                   f"distils from the images' descriptions in words, which only the bundled "
                                   f"strips have: data.source='digits' only (or 0), got data.source={data.source!r}")
    if distill and config.get("num_microbatches", 1) > 1:
      raise validation.ConfigError("num_microbatches", config.num_microbatches,
                                   f"needs a loss that is one sum over one weight; task.distill_weight={distill} adds "
                                   f"a mean over the compared states to the answers' mean: use 1 (or distill_weight 0)")
    describe_first = config.task.get("describe_first", False)  # absent from configs written before it: False
    if "describe_first" in config.task:
      validation.require_choice(config, "task.describe_first", (True, False))
    if describe_first and data.source != "digits":
      raise validation.ConfigError("task.describe_first", describe_first,
                                   f"answers from the images described in words, which only the LM of the bundled "
                                   f"strips learned to read (configs/vlm_lm.py's described texts): data.source='digits' "
                                   f"only (or False), got data.source={data.source!r}")
    if "distill_blocks" in config.task:
      validation.require_positive(config, "task.distill_blocks", allow_zero=True)
    # a connector's own fields (its `own_fields`): set off their bundled value for another connector (or flamingo's
    # resampler without latents) they would change nothing, as spatial_merge below. Training only: eval and infer
    # keep the run's model fields, and a run recorded before a field had its value here must stay readable
    got = f"model.connector={model.connector!r}" + kind.reading_settings(model)
    for name, owner in connectors.CONNECTORS.items() if mode == "train" else ():
      for field, value in owner.own_fields.items():
        if field in model and model[field] != value and not kind.reads(field, model):
          raise validation.ConfigError(f"model.{field}", model[field],
                                       f"is read by {owner.reader(name, field)} only (or {value}), got {got}")
    if model.spatial_merge > 1 and not kind.spatial:
      raise validation.ConfigError("model.spatial_merge", model.spatial_merge,
                                   f"merges the patches that become soft tokens: {spatial} only (or 1), got "
                                   f"model.connector={model.connector!r}")
    validation.require_choice(config, "data.source", SOURCES)
    for field in ("length_bucketing", "cache_features", "color"):  # absent from configs written before them: False
      if field in data:
        validation.require_choice(config, f"data.{field}", (True, False))
    if data.max_digits > vlm_digits.MAX_DIGITS:
      raise validation.ConfigError("data.max_digits", data.max_digits, f"must be in [1, {vlm_digits.MAX_DIGITS}]")
    if data.source == "digits":
      validation.require_positive(config, "data.num_train_examples", "data.num_eval_examples")
      for field in ("train_file", "eval_file"):  # a file named here would be ignored without a word
        if data.get(field):
          raise validation.ConfigError(f"data.{field}", data[field], "the bundled strips (data.source='digits') read "
                                       "no file: set data.source='tsv' (configs/vlm_tsv.py), or '' here")
      encoder_task.check_eval_split(config)
      kinds = [k.strip() for k in validation.require_string("data.kinds", data.kinds, "caption,count").split(",")
               if k.strip()]
      if not kinds or any(k not in vlm_digits.KINDS for k in kinds):
        raise validation.ConfigError("data.kinds", data.kinds, f"a comma-separated subset of {tuple(vlm_digits.KINDS)}")
    decoding_config.decoding_options(config)
    if mode == "train":  # eval and infer take the frozen parts from the run's record
      frozen.check_configs(config)
    if data.source == "tsv":
      fields = (("data.train_file",) if mode == "train" else ()) + (("data.eval_file",) if mode != "infer" else ())
      for field in fields:
        encoder_task.read_pairs_field(config, field)

  @classmethod
  def dependencies(cls, config, workdir):
    """The frozen encoder and LM runs (`frozen.dependencies`)."""
    return frozen.dependencies(config, workdir)

  # --- setup ------------------------------------------------------------------------------------

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    self.canvas = canvas(config)
    self.options = decoding_config.decoding_options(config)
    self.max_new_tokens = config.task.decoding.max_new_tokens
    self._said_cut = False  # _new_tokens_that_fit's warning, once
    # in training the frozen weights, {"encoder": params, "lm": params}; None in eval / infer (the checkpoint
    # restore sets them)
    record, tokenizer_path, self.weights = frozen.load(config, workdir, mode)
    self.encoder_model = ConfigDict(record["encoder_model"])
    self.lm_model = frozen.lm_model_config(ConfigDict(record["lm_model"]), config.model.image_positions)
    context = self.lm_model.max_length  # the frozen LM's context, as its own task bounds its answers
    if self.max_new_tokens > context - 2:  # BOS and one prompt token at least
      raise validation.ConfigError("task.decoding.max_new_tokens", self.max_new_tokens,
                                   f"must be <= {context - 2}: the frozen LM's context (model.max_length={context} "
                                   f"of {config.model.lm_workdir}) holds a prompt's BOS, its tokens and the new ones")
    self.vocab_size = record["vocab_size"]
    decoding_config.note_top_k(config, self.vocab_size)
    self.tokenizer = tokenizers.SentencePieceTokenizer(tokenizer_path)
    marker = self.tokenizer.encode(vlm_digits.IMAGE_TOKEN)
    if len(marker) != 1:
      raise validation.ConfigError("model.lm_config", config.model.lm_config,
                                   f"its tokenizer splits {vlm_digits.IMAGE_TOKEN!r} into {len(marker)} pieces")
    self.marker = marker[0]
    self.patch_size = self.encoder_model.patch_size
    self.distill_weight = float(config.task.get("distill_weight", 0.0)) if mode == "train" else 0.0
    self.distill_blocks = config.task.get("distill_blocks", 0)  # 0: every block's output
    self.train_examples = self._examples("train") if mode == "train" else []
    self.eval_examples = self._examples("eval") if mode != "infer" else []
    self.train_layouts = [self.layout(e, teacher=bool(self.distill_weight)) for e in self.train_examples]
    self.length_bucketing = bool(config.data.get("length_bucketing", False))  # absent from older runs' configs
    # Bucketed, each epoch is sorted by image count only: sorted by length too, the bundled batches hold one
    # kind of question each and exact match falls (experiments/results/intel_xeon_amx/vlm_length_bucketing.md).
    sort_keys = np.asarray([len(e.images) for e in self.train_examples]) if self.length_bucketing else None
    self._train_order = batching.EpochOrder(len(self.train_examples), sort_keys)  # a user's pairs: shuffled
    self.eval_layouts = [self.layout(e) for e in self.eval_examples]
    # A reference holding such a character cannot be generated (exact match 0, answers of '⁇').
    self.tokenizer.warn_unknown_characters(
        [str(v) for e in self.eval_examples for role, v in e.segments if role != "image"], "the eval texts",
        ", and a reference holding them cannot be generated")
    self._train_features = None  # (table [images, 1 + P, width], example i's images at offsets[i]:offsets[i + 1])
    if mode == "train" and config.data.get("cache_features", False):
      self._train_features = self._cache_features()
    self._described_states = None  # task.distill_weight: the frozen LM's states on the described training texts
    if self.distill_weight:
      self._described_states = distillation.described_states(self.train_layouts, self.lm_model, self._frozen_lm,
                                                             blocks=self.distill_blocks, weight=self.distill_weight)
    self._check_positions_fit(config)
    lengths = [len(layout.ids) for layout in self.train_layouts + self.eval_layouts]
    self.length = -(-max(lengths, default=8) // 8) * 8  # every row padded to this (static shapes)
    prompts = [p for layout in self.eval_layouts for p, _, _ in layout.targets]
    longest = max((len(self.tokenizer.encode(reference)) for layout in self.eval_layouts
                   for _, _, reference in layout.targets), default=0)
    self.eval_new_tokens = max(self.max_new_tokens, longest + 1)  # a reference's tokens and the one that ends it
    self.prompt_length = -(-max(prompts, default=8) // 8) * 8
    logging.info("VLM %s: %d train / %d eval examples, rows of %d tokens", config.model.connector,
                 len(self.train_examples), len(self.eval_examples), self.length)

  @functools.cached_property
  def _position_rows(self) -> int | None:
    """The rows of the frozen LM's learned position table (None: its positions take any length)."""
    if not position_layers.get(self.lm_model.position_encoding).max_length_table:
      return None
    return max(self.lm_model.max_length, self.lm_model.get("randomized_positions_max", 0))

  def _check_positions_fit(self, config) -> None:
    """A frozen LM with a learned position table reads no position past its rows (a longer row read NaN and the
    run ended as diverged): ConfigError naming the data field, file and lines of the examples that need more."""
    rows = self._position_rows
    if rows is None:
      return
    for side, layouts in (("train", self.train_layouts), ("eval", self.eval_layouts)):
      long = [(index, len(layout.ids)) for index, layout in enumerate(layouts) if len(layout.ids) > rows]
      if not long:
        continue
      field = "data.train_file" if side == "train" or not config.data.eval_file else "data.eval_file"
      if config.data.source != "tsv":  # the bundled texts fit the context their LM is trained with
        raise validation.ConfigError("model.lm_workdir", config.model.lm_workdir, f"its learned position table "
                                     f"holds {rows} positions, {side} example {long[0][0]} takes {long[0][1]}")
      path = validation.get_field(config, field)
      numbers = image_text.pair_line_numbers(path)
      if not config.data.eval_file:
        numbers = image_text.side_of_split(numbers, path, eval_side=side == "eval")
      problems = [(numbers[index], f"the text and its image tokens take {length} positions; the frozen LM's "
                   f"learned position table holds {rows} (model.max_length of {config.model.lm_workdir}): shorten "
                   "it, or give the LM rotary positions (posenc=rope in model.lm_config)") for index, length in long]
      raise validation.ConfigError(field, path, " ".join(str(image_text.ImageTextFormatError(path, problems)).split()))

  def _examples(self, side: str) -> list[vlm_digits.VLMExample]:
    data = self.config.data
    if data.source == "tsv":
      if side == "eval" and data.eval_file and os.path.isfile(data.train_file):  # in --mode=eval too
        splits.warn_shared(image_text.read_pair_images(data.eval_file), image_text.read_pair_images(data.train_file),
                           data.eval_file, data.train_file, "images")
      return encoder_task.read_pairs_field(self.config, "data.train_file" if side == "train" else "data.eval_file")
    kinds = tuple(k.strip() for k in data.kinds.split(",") if k.strip())
    split, count = (("train", data.num_train_examples) if side == "train" else
                    (encoder_task.eval_split(self.config), data.num_eval_examples))
    return vlm_digits.make_examples(split, count, data.seed if side == "train" else data.eval_seed,
                                    max_digits=data.max_digits, kinds=kinds, scale=data.scale)

  def _frozen_lm(self, **kwargs):
    """The language model of the frozen record, with the frozen weights when this task loaded them."""
    weights = None if self.weights is None else self.weights["lm"]  # None in eval / infer: the restore sets them
    return frozen.make_lm(self.lm_model, self.vocab_size, weights, **kwargs)

  def _frozen_encoder(self, **kwargs):
    """The image encoder of the frozen record, with the frozen weights when this task loaded them."""
    weights = None if self.weights is None else self.weights["encoder"]
    return frozen.make_encoder(self.encoder_model, weights, **kwargs)

  def _cache_features(self, chunk: int = 256):
    """The frozen encoder's features of every training image (data.cache_features), computed once as each
    step would compute them (`vlm.frozen_features`, in the compute dtype) -> (table [images, 1 + P, width],
    offsets: example i's images are table rows offsets[i]:offsets[i + 1]), or None when the table would pass
    FEATURE_CACHE_MAX_BYTES."""
    images = [image for example in self.train_examples for image in example.images]
    encoder_model = self.encoder_model
    patches = (self.canvas[0] // encoder_model.patch_size) * (self.canvas[1] // encoder_model.patch_size)
    dtype = jnp.dtype(self.config.precision.compute_dtype)
    size = len(images) * (1 + patches) * encoder_model.d_model * dtype.itemsize
    if size > FEATURE_CACHE_MAX_BYTES:
      logging.warning("data.cache_features: the %d training images' features would take %.1f GiB (more than "
                      "%.1f): the encoder runs in every step", len(images), size / 2**30,
                      FEATURE_CACHE_MAX_BYTES / 2**30)
      return None
    encoder = self._frozen_encoder(dtype=dtype)
    hide_padding = self.config.model.hide_padding
    read = nnx.jit(lambda encoder, images, pixel_valid, image_valid: vlm.frozen_features(
        encoder, images, pixel_valid, image_valid, hide_padding=hide_padding, dtype=dtype)[0])
    table = np.zeros((len(images), 1 + patches, encoder_model.d_model), dtype)
    for start in range(0, len(images), chunk):
      part = [[image] for image in images[start:start + chunk]]
      part += [part[-1]] * (chunk - len(part))  # one shape: one compiled program
      batch = vlm_digits.collate_images(part, canvas=self.canvas, max_images=1)
      features = read(encoder, batch["images"], batch["pixel_valid"], batch["image_valid"])
      table[start:start + chunk] = np.asarray(features)[:len(images) - start, 0]
    offsets = np.cumsum([0] + [len(example.images) for example in self.train_examples])
    logging.info("data.cache_features: %d training images' frozen features cached (%.0f MiB)", len(images),
                 table.nbytes / 2**20)
    return table, offsets

  # --- token layout -----------------------------------------------------------------------------

  def slots(self, image: np.ndarray) -> int:
    """SOFT_TOKEN slots of one image [h, w] (its real patch grid)."""
    grid = (-(-image.shape[0] // self.patch_size), -(-image.shape[1] // self.patch_size))
    model = self.config.model
    return connectors.slots_per_image(model.connector, grid, model)

  def layout(self, example: vlm_digits.VLMExample, *, teacher: bool = False) -> Layout:
    """The example's token layout (see the module docstring); teacher: with its described text (Layout)."""
    pieces, described = [], []
    for role, value in example.segments:
      if role == "image":
        pieces.append((role, [vlm.SOFT_TOKEN] * self.slots(example.images[value]) + [self.marker]))
        if teacher:
          described.append(self.tokenizer.encode(vlm_digits.digit_words(example.digits[value])) + [self.marker])
      else:
        pieces.append((role, self.tokenizer.encode(str(value))))
        described.append(pieces[-1][1])
    ids = [self.tokenizer.bos_id]
    teacher_ids, teacher_index = [self.tokenizer.bos_id], [-1]  # before the first image the texts agree
    seen = False
    spans = []
    for (role, piece), words in zip(pieces, described if teacher else [None] * len(pieces)):
      if role == "target":
        spans.append((len(ids), len(ids) + len(piece)))
      ids += piece
      if teacher:  # an image: its soft tokens are not matched, its marker and all text after it are
        seen = seen or role == "image"
        shared = [i for i, token in enumerate(piece) if token != vlm.SOFT_TOKEN]
        start = len(teacher_ids) + len(words) - len(shared)
        teacher_index += [-1] * (len(piece) - len(shared)) + [start + j if seen else -1 for j in range(len(shared))]
        teacher_ids += words
    ids.append(self.tokenizer.eos_id)
    ids = np.asarray(ids, np.int32)
    labels = np.append(ids[1:], self.tokenizer.eos_id).astype(np.int32)
    weights = np.zeros(len(ids), np.float32)
    targets = []
    for (start, end), reference in zip(spans, example.targets()):
      if labels[end - 1] == vlm.SOFT_TOKEN:  # an image follows: its marker ends the target
        labels[end - 1] = self.marker
      weights[start - 1:end] = 1.0
      targets.append((start, int(labels[end - 1]), reference))
    labels = np.where(labels == vlm.SOFT_TOKEN, lm_lib.PAD_ID, labels)
    if not teacher:
      return Layout(ids=ids, labels=labels, weights=weights, targets=tuple(targets))
    teacher_index.append(len(teacher_ids) if seen else -1)
    teacher_ids.append(self.tokenizer.eos_id)
    return Layout(ids=ids, labels=labels, weights=weights, targets=tuple(targets),
                  teacher_ids=np.asarray(teacher_ids, np.int32), teacher_index=np.asarray(teacher_index, np.int32))

  def _rows(self, examples, layouts, indices, *, length: int | None = None, max_images: int = MAX_IMAGES,
            features=None):
    """Right-padded token arrays [n, length] (self.length by default) and `max_images` collated image slots
    of the given examples (index -1: a weight-0 row); with `features` (`_cache_features` of these examples)
    the slots' frozen features [n, max_images, 1 + P, width] instead of their pixels."""
    n, length = len(indices), length or self.length
    tokens = np.zeros((n, length), np.int32)
    labels = np.zeros((n, length), np.int32)
    weights = np.zeros((n, length), np.float32)
    images = []
    for row, index in enumerate(indices):
      if index < 0:
        images.append(())
        continue
      layout = layouts[index]
      size = len(layout.ids)
      tokens[row, :size], labels[row, :size], weights[row, :size] = layout.ids, layout.labels, layout.weights
      images.append(examples[index].images)
    batch = vlm_digits.collate_images(images, canvas=self.canvas, max_images=max_images)
    batch.update(tokens=tokens, labels=labels, weights=weights, valid=tokens != lm_lib.PAD_ID)
    if layouts is self.train_layouts and self._described_states is not None:  # task.distill_weight
      blocks, width = self._described_states[0].shape[1:]
      target = np.zeros((n, length, blocks, width), np.float32)
      mask = np.zeros((n, length), bool)
      for row, index in enumerate(indices):
        if index >= 0:
          compared = np.flatnonzero(layouts[index].teacher_index >= 0)
          target[row, compared], mask[row, compared] = self._described_states[index], True
      batch.update(distill_target=target, distill_mask=mask)
    if features is not None:  # the cached frozen features replace the images (empty slots: zeros)
      table, offsets = features
      gathered = np.zeros((n, max_images) + table.shape[1:], table.dtype)
      for row, index in enumerate(indices):
        if index >= 0:
          gathered[row, :offsets[index + 1] - offsets[index]] = table[offsets[index]:offsets[index + 1]]
      batch["features"] = gathered
      del batch["images"]
    return batch

  # --- batches ----------------------------------------------------------------------------------

  def train_batch(self, step, *, process_index, process_count):
    size, count = self.config.batch_size, len(self.train_examples)
    local = size // process_count
    if self.length_bucketing:
      seed = self.config.seed if self.config.data.source == "tsv" else self.config.data.seed
      rows = self._train_order.batch(step, seed, size)  # the global batch: every process sizes it alike
      length = batching.round_up(max(len(self.train_layouts[i].ids) for i in rows), 8)
      max_images = max(len(self.train_examples[i].images) for i in rows)
      return self._rows(self.train_examples, self.train_layouts, rows[process_index * local:][:local],
                        length=length, max_images=max_images, features=self._train_features)
    if self.config.data.source != "tsv":  # the bundled strips are drawn at random per index: cycled as drawn
      return self._rows(self.train_examples, self.train_layouts,
                        (step * size + process_index * local + np.arange(local)) % count,
                        features=self._train_features)
    # A user's file may be sorted (by subject, by source): epoch e takes its pairs in the permutation seeded
    # by (config.seed, e), as the text tasks do (batching.epoch_order).
    rows = self._train_order.batch(step, self.config.seed, size)[process_index * local:][:local]
    return self._rows(self.train_examples, self.train_layouts, rows, features=self._train_features)

  def eval_batches(self, *, process_index, process_count):
    size = self.config.eval_batch_size
    local = size // process_count
    for start in range(0, len(self.eval_examples), size):
      rows = start + process_index * local + np.arange(local)
      yield self._rows(self.eval_examples, self.eval_layouts, np.where(rows < len(self.eval_examples), rows, -1))

  # --- model, loss, metrics ---------------------------------------------------------------------

  def make_model(self, rngs, *, dtype, param_dtype):
    model = self.config.model
    rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())  # the layers' Dropout wants a stream
    encoder = self._frozen_encoder(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    lm = self._frozen_lm(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    fields = {field: model[field] for field in connectors.CONNECTORS[model.connector].config_fields}
    return vlm.VisionLanguageModel(
        encoder, lm, connector=model.connector, image_token_id=self.marker, image_positions=model.image_positions,
        feature_positions=model.feature_positions, hide_padding=model.hide_padding, dropout_rate=model.dropout_rate,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs, **{"spatial_merge": model.spatial_merge, **fields})

  def loaded_params(self):
    return self.weights  # {"encoder": ..., "lm": ...}: the model's own paths; None outside training

  @staticmethod
  def _logits(model, batch, deterministic=True, hidden=None):
    return model(batch.get("images"), batch["pixel_valid"], batch["image_valid"], batch["tokens"], batch["valid"],
                 features=batch.get("features"), deterministic=deterministic, hidden=hidden)

  def loss_terms(self, model, batch, *, rngs):
    """The answers' summed cross-entropy and their token count (without distillation, which validation keeps
    from microbatches: its term is a mean of its own)."""
    del rngs
    logits = self._logits(model, batch, deterministic=False)
    return *optim.cross_entropy(logits, batch["labels"], batch["weights"]), {}

  def loss(self, model, batch, *, rngs):
    if not self.distill_weight:
      return super().loss(model, batch, rngs=rngs)
    hidden = []
    logits = self._logits(model, batch, deterministic=False, hidden=hidden)
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["labels"], batch["weights"])
    loss = loss_sum / jnp.maximum(weight_sum, 1.0)
    target = batch["distill_target"]
    distill = distillation.description_distillation(hidden[:target.shape[2]], target, batch["distill_mask"])
    return loss + self.distill_weight * distill, {"cross_entropy": loss, "distill": distill}

  def eval_metrics(self, model, batch):
    logits = self._logits(model, batch)
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["labels"], batch["weights"])
    correct = (jnp.argmax(logits, axis=-1) == batch["labels"]) * batch["weights"]
    return {"loss": (loss_sum, weight_sum), "token_accuracy": (jnp.sum(correct), weight_sum)}

  # --- generation -------------------------------------------------------------------------------

  @functools.cached_property
  def _generate(self):
    options, suppress, placed = self.options, self.tokenizer.never_generated_ids, self.logits_sharding
    return nnx.jit(lambda model, images, pixel_valid, image_valid, prompt, valid, keys, max_new: model.generate(
        images, pixel_valid, image_valid, prompt, valid, max_length=max_new, eos_id=tokenizers.EOS_ID,
        options=options, rng=keys, suppress_ids=suppress, logits_sharding=placed)[0], static_argnames="max_new")

  @functools.cached_property
  def _generate_text(self):
    """The frozen LM alone continuing text prompts (task.describe_first's second pass: no image, no connector)."""
    options, suppress, placed = self.options, self.tokenizer.never_generated_ids, self.logits_sharding
    return nnx.jit(lambda model, prompt, valid, keys, max_new: lm_task.generate_ids(
        model.lm, prompt, valid, keys, capacity=prompt.shape[1] + max_new, max_new_tokens=max_new, options=options,
        suppress_ids=suppress, logits_sharding=placed), static_argnames="max_new")

  def _cut(self, row, stop: int) -> str:
    """The generated ids up to the token that ends a target (or EOS, a marker, an invalid id), as text."""
    kept = []
    for token in np.asarray(row).tolist():
      if token in (stop, tokenizers.EOS_ID, self.marker, lm_lib.PAD_ID) or token < 0:
        break
      kept.append(token)
    return answers_lib.normalise(self.tokenizer.decode(kept))

  def generate(self, model, requests, max_new_tokens: int | None = None, *, text_only: bool = False,
               ids=None) -> list[str]:
    """requests: (images, prompt ids, end token id) each -> the generated text of each, in order, at most
    max_new_tokens tokens (default task.decoding.max_new_tokens) before the end token. text_only: the frozen
    LM alone continues the prompts (their images are not read; the prompts hold no soft-token slots). ids: each
    request's sampling key ids (`decoding_config.row_keys`; default its position)."""
    size = sharding.rows_batch_size(len(requests), self.config.eval_batch_size, self.rows_sharding)
    max_new = max_new_tokens or self.max_new_tokens
    outputs = []
    for start in range(0, len(requests), size):
      chunk = requests[start:start + size]
      padded = chunk + [chunk[-1]] * (size - len(chunk))  # one batch shape: one compiled program
      prompt_length = max(self.prompt_length, max(len(ids) for _, ids, _ in padded))
      new = self._new_tokens_that_fit(prompt_length, max_new)
      tokens, valid = lm_lib.left_pad([ids for _, ids, _ in padded], prompt_length)
      chunk_ids = None if ids is None else [*ids[start:start + size], *[ids[start]] * (size - len(chunk))]
      keys = decoding_config.row_keys(self.config, size, offset=start, ids=chunk_ids)
      if text_only:
        generated = self._generate_text(model, tokens, valid, keys, max_new=new)
      else:
        images = vlm_digits.collate_images([im for im, _, _ in padded], canvas=self.canvas, max_images=MAX_IMAGES)
        generated = self._generate(model, images["images"], images["pixel_valid"], images["image_valid"], tokens,
                                   valid, keys, max_new=new)
      outputs += [self._cut(row, stop) for row, (_, _, stop) in zip(np.asarray(generated), chunk)]
    return outputs

  def _new_tokens_that_fit(self, prompt_length: int, max_new: int) -> int:
    """max_new, or fewer where a learned position table ends first: past its rows the LM read NaN positions and
    wrote garbage after the last position it has. RunError where not even one new token fits."""
    rows = self._position_rows
    if rows is None or prompt_length + max_new <= rows:
      return max_new
    if prompt_length >= rows:
      raise RunError(f"prompts of {prompt_length} positions (BOS, image tokens, text) leave no room in the frozen "
                     f"LM's learned position table of {rows} rows (model.max_length of {self.config.model.lm_workdir})")
    if not self._said_cut:  # once a run
      logging.warning("Generating at most %d tokens, not %d: prompts of %d positions and the frozen LM's learned "
                      "position table of %d rows", rows - prompt_length, max_new, prompt_length, rows)
      self._said_cut = True
    return rows - prompt_length

  def _image_prompt(self, image) -> list[int]:
    """BOS, then one image: its soft-token slots and its marker (what a caption or a question follows)."""
    return [self.tokenizer.bos_id] + [vlm.SOFT_TOKEN] * self.slots(image) + [self.marker]

  def describe(self, model, images, max_new_tokens: int | None = None, ids=None) -> list[str]:
    """Each image's description: the text the model generates after the image alone (its caption, no
    question), at most max_new_tokens tokens (generate's default); ids: generate's."""
    prompts = [((image,), self._image_prompt(image), tokenizers.EOS_ID) for image in images]
    return self.generate(model, prompts, max_new_tokens, ids=ids) if prompts else []

  def eval_answers(self, model) -> list[tuple[str, int, str, str]]:
    """(kind, digits in the largest image, reference, generated answer) of every eval target, in eval order
    (`answers.eval_answers`)."""
    return answers_lib.eval_answers(self, model)

  def extra_eval(self, model):
    answers = self.eval_answers(model)
    return answers_lib.answer_metrics(answers) if answers else {}

  def infer_lines(self, model, lines):
    """A line is `image_path` (its caption) or image paths then a question, tab-separated: the last field is the
    question. One image: the answer after the image and the question (`a.png<TAB>what is their sum ?`). Two:
    each image followed by the model's caption of it, then the question, as the two-image examples are laid out
    (`a.png<TAB>b.png<TAB>which is larger ?`); with an empty question, each image's caption alone, joined by
    " | " (in training a caption before another image's text ends where that text begins, unknown here)."""
    def read(index, line):  # (the line's images, its question)
      fields = line.rstrip("\n").split("\t")
      paths, question = (fields, "") if len(fields) == 1 else (fields[:-1], fields[-1].strip())
      if len(paths) > MAX_IMAGES:
        raise ValueError(f"{len(paths)} image paths: a line holds at most {MAX_IMAGES} (the last tab-separated "
                         "field is the question)")
      if vlm_digits.IMAGE_TOKEN in question:
        raise ValueError(f"the question holds {vlm_digits.IMAGE_TOKEN!r}, the language model's image marker: "
                         "images go in the fields before it")
      if question and os.path.isfile(self.input_path(question)):  # `a.png<TAB>b.png` asked b.png as a question
        raise ValueError(f"the last field, the question, is the file {question!r}: two images take a question "
                         "after them, or an empty last field for their captions")
      if empty := [k + 1 for k, path in enumerate(paths) if not path.strip()]:
        raise ValueError(f"field {empty[0]} is an empty image path")
      return [image_text.load_image(self.input_path(path.strip()), self.canvas, grey=encoder_task.grey(self.config))
              for path in paths], question

    examples, groups, names = [], [], []  # groups: the examples whose answers make line i's; names: (line, j)
    for index, (images, question) in enumerate(task_lib.read_each(lines, read)):
      number = self.line_number(index)  # what a line's samples are keyed by, whatever lines come before it
      if not question:  # each image's caption
        groups.append(range(len(examples), len(examples) + len(images)))
        examples += [((image,), [("image", 0), ("target", None)]) for image in images]
        names += [(number, j) for j in range(len(images))]
        continue
      segments = [("image", 0)] if len(images) == 1 else [s for i in range(len(images))
                                                          for s in (("image", i), ("target", None))]
      groups.append(range(len(examples), len(examples) + 1))
      examples.append((tuple(images), segments + [("text", question), ("target", None)]))
      names.append((number, 0))
    self.tokenizer.warn_unknown_characters([line.split("\t")[-1] if "\t" in line else "" for line in lines],
                                           "the questions")
    answers = answers_lib.generate_in_turn(self, model, examples, names)
    return [" | ".join(answers[k][-1] or "(nothing)" for k in group) for group in groups]
