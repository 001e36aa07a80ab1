"""The vision-language models' image encoder: a ViT that names the digit at each position of a digit strip.

    python launch.py --config=configs/vlm_encoder.py --workdir=workdirs/vlm_encoder
    python launch.py --config=configs/vlm_encoder.py:scale=2 --workdir=workdirs/vlm_encoder_x2
    echo validation:0 | python launch.py --config=configs/vlm_encoder.py --workdir=workdirs/vlm_encoder --mode=infer

Strips of 1 to max_digits bundled digits on the canvas 8 x (8 * max_digits), times scale (see
xattn_jax/tasks/vlm/encoder.py); with 2x2 patches a strip hands on 16 to 64 patch features.

`data=pairs` trains it instead on a user's `image_path<TAB>text` pairs to name the words of each image's
caption (task "vlm_pairs_encoder", xattn_jax/tasks/vlm/pairs_encoder.py), on the canvas `canvas=HxW`
(default 32x32, 4x4 patches: 64 features), grey or with `color=true` RGB; configs/vlm_tsv.py trains it first on
the VLM's own pairs:

    python launch.py --config=configs/vlm_encoder.py:data=pairs --workdir=workdirs/my_encoder \
        --config.data.train_file=pairs.tsv [--config.data.eval_file=pairs_eval.tsv]
"""
from __future__ import annotations

from ml_collections import ConfigDict

from configs import common

SOURCES = ("digits", "pairs")  # data=...: the bundled strips, or a user's image-caption pairs


def get_config(arg=None):
  args = common.parse_arg(arg, steps=1500, width=64, blocks=3, patch=2, max_digits=4, scale=1, warmup=100,
                          data="digits", canvas="32x32", vocab=512, ngrams=2, color=False, epochs=50.0, min_steps=500)
  if args.data not in SOURCES:
    raise ValueError(f"config argument data={args.data!r}: allowed are {list(SOURCES)}")
  if args.data == "pairs":
    given = {item.partition("=")[0].strip() for item in (arg or "").split(",")}
    return pairs_config(args, patch=args.patch if "patch" in given else 4)
  config = vit_config(args, height=8 * args.scale, width=8 * args.max_digits * args.scale, patch=args.patch)
  config.task.name = "vlm_encoder"
  config.task.label_smoothing = 0.1
  config.data = ConfigDict({
      "max_digits": args.max_digits,  # digits per strip: 1..max_digits, uniform
      "scale": args.scale,            # integer upscale of the 8x8 digits
      "max_shift": 1,                 # training strips move up or down by up to this many pixels (0 = off)
      "num_eval_strips": 512,         # fixed eval strips (unseen digit images, held-out sequences)
      "eval_split": "validation",     # validation | test (vlm_digits.EVAL_SPLITS): test for a final score only
      "eval_seed": 0,
  })
  config.checkpoint.best_metric = "eval/position_accuracy"
  config.checkpoint.best_mode = "max"
  config.optimizer.eps = 1e-8
  return config


def vit_config(args, *, height: int, width: int, patch: int) -> ConfigDict:
  """What both encoders share: the loop, AdamW's b2 and weight decay, and the ViT reading an height x width
  canvas in patches of `patch` (model.grid, its learned position table: the canvas in patches)."""
  config = common.base_config(total_steps=args.steps, batch_size=64, eval_batch_size=128, log_every_steps=100,
                              eval_every_steps=500, checkpoint_every_steps=500, learning_rate=2e-3,
                              warmup_steps=args.warmup)
  config.optimizer.b2 = 0.99
  config.optimizer.weight_decay = 0.1
  config.model.name = "vit"
  config.model.patch_size = patch
  cell = max(patch, 1)  # (a patch below 1 or a bad canvas is left to validation, which names the field)
  config.model.grid = f"{height // cell}x{width // cell}"
  config.model.d_model = args.width
  config.model.num_heads = 4
  config.model.num_blocks = args.blocks
  config.model.mlp_ratio = 2
  config.model.scan_layers = False
  config.model.remat = "none"
  return config


def pairs_config(args, patch: int) -> ConfigDict:
  """The encoder of a user's pairs: names each caption's terms (data.vocab_size of them) from its image. Patches
  of 4 x 4 unless patch=P is given: a 32 x 32 canvas hands on 64 features, as a 4-digit strip does."""
  parts = args.canvas.lower().split("x")
  height, width = (int(p) if p.strip().isdigit() else 0 for p in parts) if len(parts) == 2 else (0, 0)
  config = vit_config(args, height=height, width=width, patch=patch)
  config.task.name = "vlm_pairs_encoder"
  config.data = ConfigDict({
      "canvas": args.canvas,      # "HxW": images fitted top-left into it (data.image_text)
      "color": args.color,        # RGB images (3 channels) instead of grey
      "vocab_size": args.vocab,   # the commonest caption terms, one logit each
      "ngrams": args.ngrams,      # terms: words and runs of up to this many adjacent words (their order)
      "train_file": "",           # required: --config.data.train_file=pairs.tsv
      "eval_file": "",            # optional: without one, 5% of the training images held out (data.image_text)
  })
  config.checkpoint.best_metric = "eval/word_f1"
  config.checkpoint.best_mode = "max"
  # The user's images: at most `epochs` passes (at least min_steps, at most `steps`); 2,000 pairs (31 steps a
  # pass at batch 64) keep their 1,500 steps, 48 stop at 500, where the word F1 is already flat
  # (experiments/results/intel_xeon_amx/vlm_pairs_lm_budget.md).
  config.max_epochs = args.epochs
  config.min_steps = args.min_steps
  config.model.num_classes = args.vocab
  config.model.channels = 3 if args.color else 1
  return config
