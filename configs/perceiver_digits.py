"""The Perceiver latent reader on the digits.

    python launch.py --config=configs/perceiver_digits.py --workdir=workdirs/perceiver_digits
    python launch.py --config=configs/perceiver_digits.py:posenc=rope_2d,repeats=2 --workdir=...

Measured on 2 idle cores (2026-12-05, experiments/results/intel_xeon_amx/digits_three_way_split.md): test
accuracy 0.981 at step 2,000 (0.975 / 0.961 on the test images resized to 12x12 / 16x16, 144 / 256 inputs never
seen in training; `--mode=eval --config.data.eval_split=test`), 1 min 10 s from process start to exit.
"""
from __future__ import annotations

from configs import common
from configs.digits_common import digits_config


def get_config(arg=None):
  args = common.parse_arg(arg, steps=2000, posenc="fourier", latents=32, width=64, blocks=2, repeats=1, patch=1)
  config = digits_config(total_steps=args.steps, learning_rate=3e-3)
  config.model.name = "perceiver"
  config.model.position_encoding = args.posenc  # one of xattn_jax.models.latent_reader.grid_encodings()
  config.model.patch_size = args.patch      # 1: pixels are the elements (M = 64 on 8x8 images)
  side = 8 // max(args.patch, 1)            # (a patch below 1 is left to validation, which names the field)
  config.model.grid = f"{side}x{side}"      # element grid in training (learned_2d table)
  config.model.num_latents = args.latents   # N
  config.model.d_model = args.width
  config.model.num_heads = 4
  config.model.num_blocks = args.blocks     # latent self-attention blocks ...
  config.model.num_repeats = args.repeats   # ... run this many times with shared weights
  config.model.mlp_ratio = 2
  config.model.scan_layers = False
  config.model.remat = "none"
  return config
