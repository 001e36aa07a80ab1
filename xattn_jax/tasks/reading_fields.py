"""The model fields a sequence model reads its trained parameters by, without changing them: a task's
`eval_model_fields` (training.task) frees them for eval and infer.

  model.max_length                      the positions the model may address, but where it sizes a learned
                                        position table (an encoding with max_length_table, "learned"): then
                                        the run's rows
  model.rope_scaling, rope_scaling_factor   RoPE position interpolation / NTK-aware scaling at inference
  model.randomized_positions_at_eval    drawn positions at eval (Ruoss et al.)
  model.implementation                  the attention op's implementation
Only the fields the config has are named (a run's config.py written before one existed lacks it).
"""
from __future__ import annotations

from xattn_jax.layers import positions as position_layers

READING_FIELDS = ("rope_scaling", "rope_scaling_factor", "randomized_positions_at_eval", "implementation")


def position_reading_fields(config) -> tuple[str, ...]:
  """The dotted model.* fields of `config` that eval and infer may set otherwise than training did."""
  model = config.model
  encoding = position_layers.POSITION_ENCODINGS.get(model.get("position_encoding"))
  names = READING_FIELDS + (() if encoding is not None and encoding.max_length_table else ("max_length",))
  return tuple(f"model.{name}" for name in names if name in model)
