"""Learned queries (BLIP-2 Q-Former) over a frozen ViT's patch features, or the LLaVA-style MLP connector.

    python launch.py --config=configs/qformer_digits.py --workdir=workdirs/qformer_digits
    python launch.py --config=configs/qformer_digits.py:connector=llava --workdir=workdirs/llava_digits

The frozen encoder is the ViT trained by `model.encoder_config` (configs/vit_digits.py) in
`model.encoder_workdir`: the task declares it as a dependency, so launch.py trains (or resumes) it there
first when that workdir holds no finished run, and refuses a run there made with another model config.

Measured on 2 idle cores (2026-12-05, experiments/results/intel_xeon_amx/digits_three_way_split.md), test
accuracy (`--mode=eval --config.data.eval_split=test`): the ViT (mean-pooled head) 0.983 after 2,000 steps; on
its frozen features the Q-Former 0.983 after 1,500 steps handing on N = 8 tokens (1 min 12 s wall for both), the
MLP connector 0.986 handing on M = 17 tokens (25 s).
"""
from __future__ import annotations

from configs import common
from configs.digits_common import digits_config


def get_config(arg=None):
  args = common.parse_arg(arg, steps=1500, connector="qformer", queries=8, encoder="workdirs/vit_digits")
  config = digits_config(total_steps=args.steps, learning_rate=2e-3)
  config.model.name = "qformer"
  config.model.connector = args.connector   # qformer: N = num_queries tokens | llava: one token per feature (LLaVA-1.5 MLP)
  config.model.encoder_workdir = args.encoder
  config.model.encoder_config = "configs/vit_digits.py"  # trains the encoder when its workdir is empty
  # BLIP-2 reads 257 ViT outputs with 32 queries (the model's default); this ViT has 1 + 16 outputs on
  # 8x8 digits (2x2 patches), so 8 queries keep N < M (and 32 would cost 3x the time per step here).
  config.task.label_smoothing = 0.1
  config.model.num_queries = args.queries
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.num_blocks = 2               # query blocks; cross-attention in every ...
  config.model.cross_attention_every = 2    # ... second one (blocks 0, 2, ...), as BLIP-2
  config.model.num_consumer_blocks = 1      # self-attention over the handed-on tokens before the head
  config.model.mlp_ratio = 2
  return config
