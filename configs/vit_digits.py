"""The small ViT trained on the digits, later frozen as the Q-Former's image encoder.

    python launch.py --config=configs/vit_digits.py --workdir=workdirs/vit_digits
"""
from __future__ import annotations

from configs import common
from configs.digits_common import digits_config


def get_config(arg=None):
  args = common.parse_arg(arg, steps=1500, width=64, blocks=3, patch=1)
  config = digits_config(total_steps=args.steps, learning_rate=2e-3)
  config.model.name = "vit"
  config.model.patch_size = args.patch      # 1: every pixel is a token (M = 64 on 8x8 images)
  config.model.grid = f"{8 // args.patch}x{8 // args.patch}"  # the learned table's patch grid
  config.model.d_model = args.width
  config.model.num_heads = 4
  config.model.num_blocks = args.blocks
  config.model.mlp_ratio = 2
  config.model.scan_layers = False
  config.model.remat = "none"
  return config
