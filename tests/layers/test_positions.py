"""Properties of the position-encoding modules chosen by name (xattn_jax.layers.positions)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xattn_jax.layers import positions as position_layers
from xattn_jax.layers.attention import MultiHeadAttention
from xattn_jax.layers.rotary import ROTARY_KINDS
from xattn_jax.ops import positions as positions_ops

GRID_ENCODINGS = ("learned_2d", "sincos_2d", "fourier")


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _make(name, **options):
  options = {"features": 16, "max_length": 8, "grid": (3, 4), "head_dim": 8, **options}
  return position_layers.make_position_encoding(name, rngs=nnx.Rngs(0), **options)


@functools.partial(nnx.jit, static_argnames=("grid",))
def _add(encoding, x, positions=None, grid=None):
  return encoding.add_to_inputs(x, positions, grid=grid)


def test_unknown_position_encoding_name_raises_listing_exactly_the_registered_names():
  with pytest.raises(ValueError) as error:
    _make("alibi_typo")
  assert str(error.value).endswith("allowed: " + ", ".join(position_layers.POSITION_ENCODINGS))


@pytest.mark.parametrize("name, missing", [("learned", "max_length"), ("learned_2d", "grid"),
                                           ("fourier", "grid"), ("mrope", "head_dim")])
def test_missing_required_option_raises_naming_it(name, missing):
  with pytest.raises(ValueError, match=missing):
    _make(name, **{missing: None})


def test_rope_with_odd_rotary_dim_raises_naming_rotary_dim():
  with pytest.raises(ValueError, match="rotary_dim"):
    _make("rope", rotary_dim=3)


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_attention_over_additive_positions_is_not_permutation_equivariant(name):
  encoding, layer = _make(name), MultiHeadAttention(4, 16, rngs=nnx.Rngs(1))
  run = nnx.jit(lambda encoding, layer, x: layer(encoding.add_to_inputs(x)))
  x = _normal(0, (2, 6, 16))
  permutation = np.array([1, 0, 2, 3, 5, 4])
  assert not np.allclose(run(encoding, layer, x[:, permutation]), run(encoding, layer, x)[:, permutation],
                         atol=1e-3)


@pytest.mark.parametrize("name, kind", [("none", None), ("rope", "rope"), ("rope_2d", "rope_2d"),
                                        ("mrope", "mrope")])
def test_rotary_and_none_encodings_leave_inputs_unchanged(name, kind):
  encoding = _make(name)
  x = _normal(1, (2, 6, 16))
  np.testing.assert_array_equal(encoding.add_to_inputs(x), x)
  assert (encoding.rotary is None) if kind is None else encoding.rotary.kind == kind


def test_learned_positions_add_table_row_at_each_position():
  encoding = _make("learned")
  positions = np.array([[0, 5, 7], [3, 3, 1]])
  out = _add(encoding, np.zeros((2, 3, 16), np.float32), positions)
  np.testing.assert_array_equal(out, encoding.table[...][positions])


def test_learned_positions_longer_than_table_raise_naming_table_size():
  with pytest.raises(ValueError, match="8 rows"):
    _make("learned").add_to_inputs(np.zeros((1, 9, 16), np.float32))


@pytest.mark.parametrize("name", GRID_ENCODINGS)
def test_grid_encoding_default_positions_are_the_row_major_grid(name):
  encoding = _make(name, num_extra_tokens=1)
  x = _normal(2, (2, 13, 16))
  grid_positions = np.broadcast_to(np.asarray(positions_ops.grid_positions(3, 4)), (2, 12, 2))
  np.testing.assert_allclose(_add(encoding, x), _add(encoding, x, grid_positions), atol=1e-6)


def test_learned_2d_adds_its_class_row_and_grid_rows():
  encoding = _make("learned_2d", num_extra_tokens=1)
  out = _add(encoding, np.zeros((2, 13, 16), np.float32))
  np.testing.assert_array_equal(out[0], encoding.table[...])


def test_learned_2d_on_another_grid_uses_the_resized_table():
  encoding = _make("learned_2d", num_extra_tokens=1)
  out = _add(encoding, np.zeros((1, 21, 16), np.float32), grid=(4, 5))
  resized = positions_ops.resize_2d_table(encoding.table[...], (3, 4), (4, 5), num_extra_tokens=1)
  np.testing.assert_allclose(out[0], resized, atol=1e-6)


@pytest.mark.parametrize("cell", [(0, 4), (1, -1), (3, 0), (-1, 2)])
def test_learned_2d_refuses_a_cell_off_its_grid_and_reads_nan_under_jit(cell):
  # flattened as row * width + column, (0, 4) would read the row of (1, 0)
  encoding, x = _make("learned_2d"), np.zeros((1, 1, 16), np.float32)
  with pytest.raises(ValueError, match=rf"cells of the 3x4 grid, got \({cell[0]}, {cell[1]}\)"):
    encoding.add_to_inputs(x, np.array([[cell]]))
  assert np.isnan(_add(encoding, x, np.array([[cell]]))).all()
  np.testing.assert_array_equal(_add(encoding, x, np.array([[(1, 3)]]))[0, 0], encoding.table[...][7])
  # cells a jitted function closes over are known, so checked (jnp's ops on them were traced: an error)
  cells = jnp.array([[cell]])
  with pytest.raises(ValueError, match=rf"cells of the 3x4 grid, got \({cell[0]}, {cell[1]}\)"):
    nnx.jit(lambda e: e.add_to_inputs(x, cells))(encoding)


def test_fourier_encoding_projects_fourier_features_of_the_normalized_grid():
  encoding = _make("fourier", num_fourier_bands=4)
  out = _add(encoding, np.zeros((1, 12, 16), np.float32))
  features = positions_ops.fourier_features(positions_ops.normalized_grid(3, 4), 4, (3, 4))
  np.testing.assert_allclose(out[0], encoding.projection(features), atol=1e-5)


def test_grid_encoding_with_wrong_token_count_raises_naming_positions():
  with pytest.raises(ValueError, match="positions"):
    _make("sincos_2d", num_extra_tokens=1).add_to_inputs(np.zeros((1, 12, 16), np.float32))


def test_mrope_attention_on_text_positions_equals_rope_attention():
  # Text tokens carry the same index on the time, height and width axes (Qwen2-VL), where MRoPE is RoPE.
  mrope, rope = _make("mrope").rotary, _make("rope").rotary
  text_positions = np.broadcast_to(np.arange(6), (2, 6))
  x = _normal(3, (2, 6, 32))
  run = nnx.jit(lambda layer, x, p: layer(x, query_positions=p, is_causal=True))
  out_mrope = run(MultiHeadAttention(4, 32, rotary=mrope, rngs=nnx.Rngs(2)), x, np.stack([text_positions] * 3))
  out_rope = run(MultiHeadAttention(4, 32, rotary=rope, rngs=nnx.Rngs(2)), x, text_positions)
  np.testing.assert_allclose(out_mrope, out_rope, atol=1e-5)


def test_rope_2d_attention_without_positions_raises_naming_the_positions():
  layer = MultiHeadAttention(4, 32, rotary=_make("rope_2d").rotary, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"(query|key)_positions \(\[batch, length, 2\]\)"):
    layer(_normal(4, (1, 4, 32)))


@pytest.mark.parametrize("head_dim", [2, 4])
def test_mrope_default_sections_refuse_heads_too_narrow_for_three_axes(head_dim):
  # 3/8 of 1 or 2 frequency pairs is 0: height and width would get no frequencies at all.
  with pytest.raises(ValueError, match=f"rotary_dim >= 6 .*got rotary_dim={head_dim}"):
    _make("mrope", head_dim=head_dim)
  assert _make("mrope", head_dim=6).rotary.sections == (1, 1, 1)


@pytest.mark.parametrize("name", ["learned", "sinusoidal", *GRID_ENCODINGS])
def test_add_to_inputs_refuses_x_of_another_width_naming_both(name):
  # features=16: an x of width 8 failed in the addition (a TypeError of broadcasting, or of concatenate).
  length = 4 if name in ("learned", "sinusoidal") else 12
  with pytest.raises(ValueError, match=r"x must be \[batch, length, 16\] .*got x\[2, %d, 8\]" % length):
    _add(_make(name), np.zeros((2, length, 8), np.float32))


@pytest.mark.parametrize("max_length", [0, -1])
def test_learned_table_refuses_max_length_below_one(max_length):
  # Built a table of no rows without a word; only a later add_to_inputs said that no position fit it.
  with pytest.raises(ValueError, match=f"make_position_encoding: max_length must be a positive int, got {max_length}"):
    _make("learned", max_length=max_length)


@pytest.mark.parametrize("name", GRID_ENCODINGS)
def test_grid_encodings_refuse_a_grid_that_is_not_ints(name):
  # int() truncated (2.5, 4) to the 2 x 4 grid.
  with pytest.raises(ValueError, match=r"grid must be \(height, width\) of positive ints, got grid=\(2.5, 4\)"):
    _make(name, grid=(2.5, 4))


@pytest.mark.parametrize("kind", ["rope", "rope_2d"])
def test_rotary_spec_refuses_sections_its_kind_would_ignore(kind):
  """RotarySpec(kind="rope", sections=(2, 3, 3)) built and rotated as plain rope: only mrope reads sections."""
  from xattn_jax.layers.rotary import RotarySpec
  with pytest.raises(ValueError, match=rf"kind='{kind}' takes no sections .*got sections=\(2, 3, 3\)"):
    RotarySpec(kind=kind, sections=(2, 3, 3))


def test_rotary_spec_refuses_empty_mrope_sections():
  from xattn_jax.layers.rotary import RotarySpec
  with pytest.raises(ValueError, match=r"sections must be positive ints .*got sections=\(2, 0, 0\)"):
    RotarySpec(kind="mrope", sections=(2, 0, 0))


@pytest.mark.parametrize("name", ["sinusoidal", *GRID_ENCODINGS])
def test_positions_may_be_python_lists(name):
  encoding = _make(name)
  if name == "sinusoidal":
    x, positions = np.zeros((1, 3, 16), np.float32), [[0, 2, 5]]
  else:
    x, positions = np.zeros((1, 2, 16), np.float32), [[[0, 1], [2, 3]]]
  np.testing.assert_allclose(encoding.add_to_inputs(x, positions), encoding.add_to_inputs(x, np.asarray(positions)))


# --- the registry's declarations --------------------------------------------------------------

@pytest.mark.parametrize("name", list(position_layers.POSITION_ENCODINGS))
def test_every_registered_encoding_acts_as_its_declared_role(name):
  """What the models rely on from an entry's role, for every entry (one registered later too): "none" changes
  nothing, "additive" changes the inputs only, "rotary" hands the attention layers a rotary spec only, "bias" adds
  [.., q, k] scores that depend on the positions only."""
  entry, encoding = position_layers.get(name), _make(name, num_heads=2)
  tokens = 6 if "sequence" in entry.layouts else 12  # the grid encodings' 3 x 4 grid
  x = _normal(7, (2, tokens, 16))
  added = np.asarray(encoding.add_to_inputs(x))
  assert added.shape == x.shape
  assert (encoding.rotary is not None) == (entry.role == "rotary")
  assert np.array_equal(added, x) == (entry.role != "additive"), "only an additive encoding changes the inputs"
  if "sequence" not in entry.layouts:
    return
  positions = np.broadcast_to(np.arange(tokens, dtype=np.int32), (2, tokens))
  params = nnx.state(encoding, nnx.Param)  # a learned bias may start at zero (T5's): random values, as trained
  nnx.update(encoding, jax.tree.map(lambda p: jnp.asarray(_normal(8, p.shape)), params))
  bias = encoding.attention_bias(positions, positions)
  assert (bias is not None) == (entry.role == "bias"), "only a bias encoding adds to the scores"
  if bias is not None:
    bias = np.broadcast_to(np.asarray(bias), (2, 2, tokens, tokens))
    assert np.ptp(bias) > 0, "a bias the same for every offset changes no attention weight"
    shifted = np.asarray(encoding.attention_bias(positions + 5, positions + 5))
    np.testing.assert_allclose(np.broadcast_to(shifted, bias.shape), bias, atol=1e-6)  # offsets, not positions


@pytest.mark.parametrize("kind", ["rope", "rope_2d"])
def test_a_rotary_kinds_declared_width_multiple_is_the_rule_its_op_enforces(kind):
  rotary = ROTARY_KINDS[kind]
  x = _normal(5, (1, 3, 1, 8))
  positions = np.zeros((1, 3) if rotary.positions == "sequence" else (1, 3, 2), np.int32)
  assert rotary.op(x, positions, rotary_dim=rotary.multiple_of).shape == x.shape
  with pytest.raises(ValueError, match=f"multiple of {rotary.multiple_of}"):
    rotary.op(x, positions, rotary_dim=rotary.multiple_of + 2 if rotary.multiple_of > 2 else 3)


def test_names_by_layout_are_what_each_layout_takes():
  # the built-ins of each layout, and no other layout's: an entry added to the registry may join any of them
  sequence, grid = position_layers.names(layout="sequence"), position_layers.names(layout="grid")
  assert sequence[:6] == ("none", "learned", "sinusoidal", "rope", "alibi", "t5_bias")
  assert {"none", "learned_2d", "sincos_2d", "fourier", "rope_2d"} <= set(grid)
  assert "mrope" in position_layers.names(layout="multimodal")
  assert not {"learned", "rope", "mrope"} & set(grid) and not {"learned_2d", "rope_2d", "mrope"} & set(sequence)


# --- randomized positions ---------------------------------------------------------------------

RANDOMIZED = position_layers.RandomizedPositions(max_position=32)


def test_sequence_positions_without_randomization_are_0_to_n_minus_1_even_with_an_rng():
  positions, highest = _make("sinusoidal").sequence_positions(2, 5, rng=jax.random.key(0))
  np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(5), (2, 5)))
  assert highest == 4


def test_randomized_sequence_positions_are_drawn_from_the_training_rng():
  encoding = _make("rope", randomized=RANDOMIZED)
  positions, highest = encoding.sequence_positions(2, 5, rng=jax.random.key(0))
  np.testing.assert_array_equal(positions, positions_ops.randomized_positions(jax.random.key(0), 2, 5, 32))
  assert highest == 31


def test_randomized_positions_default_to_0_to_n_minus_1_without_an_rng():
  positions, _ = _make("learned", randomized=RANDOMIZED).sequence_positions(2, 5)
  np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(5), (2, 5)))


def test_randomized_positions_at_eval_are_a_fixed_draw_without_an_rng():
  randomized = position_layers.RandomizedPositions(max_position=32, at_eval=True, eval_seed=7)
  positions, _ = _make("alibi", num_heads=2, randomized=randomized).sequence_positions(2, 5)
  np.testing.assert_array_equal(positions, positions_ops.randomized_positions(jax.random.key(7), 2, 5, 32))


def test_learned_table_has_a_row_for_every_randomized_position():
  assert _make("learned", randomized=RANDOMIZED).table.shape == (32, 16)  # max_length is 8


@pytest.mark.parametrize("name", ["learned_2d", "fourier", "rope_2d", "mrope"])
def test_randomized_positions_are_refused_for_encodings_not_of_sequence_indices(name):
  with pytest.raises(ValueError, match="randomized positions apply to"):
    _make(name, randomized=RANDOMIZED)


def test_randomized_option_refuses_a_negative_max_position_naming_it():
  with pytest.raises(ValueError, match="max_position must be an int >= 0"):
    position_layers.RandomizedPositions(max_position=-1)
