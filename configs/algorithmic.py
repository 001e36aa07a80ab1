"""Length generalization: train the translator to reverse (or copy) strings of up to 32 symbols,
evaluate exact match on lengths 1-32, 33-64 and 65-128.

    python launch.py --config=configs/algorithmic.py:posenc=alibi --workdir=workdirs/alg_alibi
    python launch.py --config=configs/algorithmic.py:posenc=rope,operation=copy --workdir=... \
        --config.model.rope_scaling=ntk --config.model.rope_scaling_factor=4
    echo abcabd | python launch.py --config=configs/algorithmic.py:posenc=alibi --workdir=workdirs/alg_alibi \
        --mode=infer
    python launch.py --config=configs/algorithmic.py:posenc=rope,randomized=256 --workdir=...

`randomized=N` trains on randomized positions (Ruoss et al. 2023): each string gets sorted distinct
positions drawn from [0, N) instead of 0..n-1; N must cover the longest eval string plus EOS (129
with the default bands). Evaluation uses 0..n-1 unless model.randomized_positions_at_eval is set.
"""
from __future__ import annotations

from configs import common

SIZES = {
    # d_model, num_heads, num_layers (encoder and decoder each), mlp_dim
    "micro": (32, 2, 1, 64),   # smoke tests only
    "tiny": (64, 4, 2, 256),
    "small": (128, 4, 3, 512),
}


def get_config(arg=None):
  args = common.parse_arg(arg, size="tiny", posenc="sinusoidal", operation="reverse", randomized=0)
  if args.size not in SIZES:
    raise ValueError(f"config argument size={args.size!r}: allowed sizes are {sorted(SIZES)}")
  config = common.base_config(total_steps=3000, batch_size=64, eval_batch_size=64, log_every_steps=100,
                              eval_every_steps=1000, checkpoint_every_steps=1000, learning_rate=1e-3,
                              warmup_steps=200)
  config.checkpoint.best_metric = ""   # the last step is the result; eval runs on every band

  config.task.name = "algorithmic"
  config.task.operation = args.operation     # reverse | copy
  config.task.num_symbols = 16
  config.task.min_length = 1
  config.task.train_max_length = 32
  config.task.eval_bands = "1-32,33-64,65-128"  # inclusive length ranges; one exact-match metric each
  config.task.num_eval_examples = 128           # per band
  config.task.label_smoothing = 0.0

  d_model, num_heads, num_layers, mlp_dim = SIZES[args.size]
  config.model.name = "translator"
  config.model.position_encoding = args.posenc  # one of xattn_jax.models.translator.position_encodings()
  config.model.d_model = d_model
  config.model.num_heads = num_heads
  config.model.num_layers = num_layers
  config.model.mlp_dim = mlp_dim
  config.model.rope_scaling = ""          # "" | linear | ntk (RoPE length scaling)
  config.model.rope_scaling_factor = 1.0
  # Randomized positions: 0 = off, else training draws positions from [0, randomized_positions_max).
  config.model.randomized_positions_max = args.randomized
  config.model.randomized_positions_at_eval = False  # evaluation and decoding: 0..n-1 (True: drawn)
  config.model.scan_layers = False
  config.model.remat = "none"             # none | full | dots | dots_no_batch
  config.model.implementation = ""        # ops.attention.IMPLEMENTATIONS; "" = the op's default
  return config
