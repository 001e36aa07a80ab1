"""Length generalization of a decoder-only model (Kazemnejad et al. 2023's setup): train on inputs of 1..20
symbols in the `input SEP output` format, evaluate exact match on 1-20, 21-40 and 41-80.

    python launch.py --config=configs/lm_algorithmic.py:operation=copy,posenc=rope --workdir=workdirs/lm_copy_rope
    python launch.py --config=configs/lm_algorithmic.py:operation=sort,posenc=none --workdir=workdirs/lm_sort_nope
    echo abcabd | python launch.py --config=configs/lm_algorithmic.py:operation=reverse,posenc=alibi \
        --workdir=workdirs/lm_rev_alibi --mode=infer

The argument names are those of configs/algorithmic.py (size, posenc, operation); operations: copy |
reverse | sort | duplicate | parity (data/lm_algorithmic.py).
"""
from __future__ import annotations

from ml_collections import ConfigDict

from configs import common
from xattn_jax.data import lm_algorithmic

SIZES = {
    # d_model, num_heads, num_layers, mlp_dim
    "micro": (32, 2, 1, 64),    # smoke tests only
    "tiny": (64, 4, 2, 256),
    "small": (128, 4, 4, 512),  # the grid size: 4 layers, d_model 128, 4 heads
}


def get_config(arg=None):
  args = common.parse_arg(arg, size="small", posenc="rope", operation="copy")
  if args.size not in SIZES:
    raise ValueError(f"config argument size={args.size!r}: allowed sizes are {sorted(SIZES)}")
  config = common.base_config(total_steps=3000, batch_size=64, eval_batch_size=64, log_every_steps=100,
                              eval_every_steps=1000, checkpoint_every_steps=1000, learning_rate=1e-3,
                              warmup_steps=200)
  config.checkpoint.best_metric = ""   # the last step is the result; eval runs on every band

  config.task.name = "lm_algorithmic"
  config.task.operation = args.operation     # copy | reverse | sort | duplicate | parity
  config.task.num_symbols = 16
  config.task.min_length = 1
  config.task.train_max_length = 20
  config.task.eval_bands = "1-20,21-40,41-80"  # inclusive input-length ranges; one exact-match metric each
  config.task.num_eval_examples = 128          # per band
  config.task.decoding = ConfigDict({"method": "greedy", "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                     "beam_size": 4, "alpha": 0.6, "seed": 0, "cache_halves": True})

  d_model, num_heads, num_layers, mlp_dim = SIZES[args.size]
  config.model.name = "lm"
  config.model.d_model = d_model
  config.model.num_heads = num_heads
  config.model.num_kv_heads = 0
  config.model.num_layers = num_layers
  config.model.mlp_dim = mlp_dim
  # Positions of the longest eval row (the task builds the model with its own longest row's, from task.eval_bands;
  # training refuses another value than that or this one, which it would ignore).
  config.model.max_length = lm_algorithmic.row_width(args.operation, lm_algorithmic.CONFIG_LONGEST_INPUT) + 1 \
      if args.operation in lm_algorithmic.OPERATIONS else 1
  config.model.position_encoding = args.posenc  # one of xattn_jax.models.lm.position_encodings()
  config.model.rope_scaling = ""
  config.model.rope_scaling_factor = 1.0
  config.model.mrope_sections = ()  # mrope's (time, height, width) frequency pairs; () = Qwen2-VL's 2:3:3 split
  # Randomized positions (Ruoss et al. 2023; not with mrope): 0 = off, else training draws each document's
  # positions from [0, randomized_positions_max) (>= model.max_length), sorted.
  config.model.randomized_positions_max = 0
  config.model.randomized_positions_at_eval = False  # evaluation and decoding: 0..n-1 (True: drawn)
  config.model.norm_type = "layernorm"
  config.model.mlp_type = "mlp"
  config.model.activation = "gelu"
  config.model.tie_output = True
  config.model.dropout_rate = 0.0
  config.model.scan_layers = False
  config.model.remat = "none"
  config.model.implementation = ""
  return config
