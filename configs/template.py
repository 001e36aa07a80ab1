"""The template task (xattn_jax/tasks/template.py): reverse random letter strings. Tiny, synthetic, for
tests and as the pattern to copy for a new task.

    python launch.py --config=configs/template.py:size=tiny,posenc=rope --workdir=workdirs/template
    echo hello | python launch.py --config=configs/template.py:size=tiny --workdir=workdirs/template \
        --mode=infer
"""
from __future__ import annotations

from configs import common

SIZES = {
    # d_model, num_heads, num_layers, mlp_dim
    "tiny": (32, 2, 1, 64),
    "small": (64, 4, 2, 128),
    "base": (128, 4, 4, 256),
}


def get_config(arg=None):
  args = common.parse_arg(arg, size="small", posenc="learned", scan=False)
  if args.size not in SIZES:
    raise ValueError(f"config argument size={args.size!r}: allowed sizes are {sorted(SIZES)}")
  config = common.base_config(total_steps=2000, log_every_steps=100, learning_rate=3e-3)
  config.task.name = "template"
  config.task.min_length = 1
  config.task.max_length = 12         # strings are padded to this length
  config.task.num_eval_examples = 256
  config.task.label_smoothing = 0.0

  d_model, num_heads, num_layers, mlp_dim = SIZES[args.size]
  config.model.name = "reverser"
  config.model.d_model = d_model
  config.model.num_heads = num_heads
  config.model.num_layers = num_layers
  config.model.mlp_dim = mlp_dim
  config.model.position_encoding = args.posenc  # the registry's text encodings: tasks/template.py
  config.model.rotary_dim = 0         # rope / mrope; 0 = the whole head_dim
  # mrope: (time, height, width) frequency pairs summing to rotary_dim / 2; () = Qwen2-VL's 2:3:3 split of
  # whatever head the model has (a d_model or num_heads override keeps it valid)
  config.model.mrope_sections = ()
  config.model.dropout_rate = 0.0     # residual dropout (exact resume: keys depend on (seed, step))
  config.model.scan_layers = args.scan
  config.model.remat = "none"         # none | full | dots | dots_no_batch
  return config
