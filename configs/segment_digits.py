"""Promptable segmentation of composed digits: SAM's two-way decoder on a small ViT.

    python launch.py --config=configs/segment_digits.py --workdir=workdirs/segment_digits
    python launch.py --config=configs/segment_digits.py:freeze --workdir=workdirs/segment_frozen
    echo "test:0" | python launch.py --config=configs/segment_digits.py --workdir=workdirs/segment_digits --mode=infer

Scenes: 2-4 digits (8x8, upscaled to 12x12) on a 32x32 canvas; 4x4 patches give the encoder M = 64
features. `freeze` keeps the ViT at its random initialisation (only the neck, prompt encoder and decoder
train): a check that the decoder is not what learns the image.
"""
from __future__ import annotations

from ml_collections import ConfigDict

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, steps=2000, batch=32, freeze=False, canvas=32, digit_size=12)
  config = common.base_config(total_steps=args.steps, batch_size=args.batch, eval_batch_size=64,
                              log_every_steps=100, eval_every_steps=1000, checkpoint_every_steps=1000,
                              learning_rate=2e-3, warmup_steps=100)
  config.task.name = "segment"
  config.task.num_masks = 3                 # masks per prompt (SAM's multimask output)
  config.task.iou_loss_weight = 1.0         # the IoU head's squared error, added to the mask loss
  config.task.all_masks_loss_weight = 0.05  # the mean loss of all masks, added to the best one's (no dead masks)
  # Prompt kinds of the training batches, by weight (segment_digits.PROMPT_KINDS).
  config.task.prompt_mix = ConfigDict({"click": 0.35, "clicks": 0.15, "box": 0.3, "ambiguous": 0.2})
  config.task.num_eval_scenes = 200         # eval scenes: a click and a box each, and an ambiguous click
  config.task.num_plot_examples = 6         # eval prompts drawn into workdir/segment_plots (0 = none)
  config.data = ConfigDict({
      "canvas": args.canvas,                # square canvas side in pixels
      "digit_size": args.digit_size,        # each 8x8 digit resized to this side
      "min_digits": 2,
      "max_digits": 4,
      "threshold": 4.0,                     # a digit's mask: its pixels above this (0..16 scale)
      "min_visible": 0.6,                   # share of each mask no other digit covers
      "max_clicks": 3,                      # clicks of a "clicks" prompt (also the padded prompt length)
      "test_fraction": 0.2,                 # source images held out for the test scenes
      "validation_fraction": 0.1,           # of each class's other images, for the validation scenes
      "split_seed": 0,
      # the scenes eval reads (digits.EVAL_SPLITS): validation while training (what checkpoint.best_metric and
      # early stopping read); test for the final score: launch.py --mode=eval --config.data.eval_split=test
      "eval_split": "validation",
  })
  config.model.name = "sam"
  config.model.patch_size = 4
  config.model.d_model = 64                 # the two-way transformer's width
  config.model.num_heads = 4
  config.model.num_blocks = 2               # two-way blocks (SAM: 2)
  config.model.mlp_dim = 256
  config.model.mask_features = 16           # channels of the upsampled features the masks are read from
  config.model.fourier_scale = 1.0          # std of the random Fourier matrix (SAM: 1)
  config.model.encoder = ConfigDict({
      "d_model": 64, "num_heads": 4, "num_blocks": 3, "mlp_ratio": 2,
      "freeze": args.freeze,                # True: FrozenParam, never trained
  })
  config.checkpoint.best_metric = "eval/click_mean_iou"
  config.checkpoint.best_mode = "max"
  config.optimizer.b2 = 0.99
  config.optimizer.eps = 1e-8
  config.optimizer.weight_decay = 0.01
  return config
