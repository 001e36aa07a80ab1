"""Properties of the position encodings in xattn_jax.ops.positions and xattn_jax.ops.relative_bias."""
import math

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xattn_jax.ops import positions as P
from xattn_jax.ops import relative_bias as R

FAST = hypothesis.settings(max_examples=8, deadline=None, derandomize=True)


# Jitted once per shape: op-by-op dispatch compiles every primitive per shape (~1.5 s per RoPE call here).
ROPE_OPTIONS = ("base", "rotary_dim", "layout", "scaling", "scaling_factor")
rope = jax.jit(P.apply_rope, static_argnames=ROPE_OPTIONS)
rope_2d = jax.jit(P.apply_rope_2d, static_argnames=ROPE_OPTIONS)
mrope = jax.jit(P.apply_mrope, static_argnames=("sections",) + ROPE_OPTIONS)
sinusoidal = jax.jit(P.sinusoidal, static_argnames=("dim", "base"))
fourier_features = jax.jit(P.fourier_features, static_argnames=("num_bands", "max_resolution", "concat_pos"))
resize = jax.jit(P.resize_2d_table, static_argnames=("old_grid", "new_grid", "method", "num_extra_tokens",
                                                     "align_corners"))
alibi_bias = jax.jit(R.alibi_bias, static_argnames=("causal",))
t5_bucket = jax.jit(R.t5_relative_position_bucket, static_argnames=("bidirectional", "num_buckets", "max_distance"))
t5_relative_bias = jax.jit(R.t5_relative_bias, static_argnames=("bidirectional", "max_distance"))


def _normal(seed, shape, dtype=jnp.float32):
  """Standard normal test input, drawn with numpy so that no JAX kernel compiles per shape."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _score(q, k):
  """<q, k> per head for x [1, 1, heads, head_dim] -> [heads]."""
  return jnp.einsum("b t n h, b t n h -> n", q, k)


# ---------------------------------------------------------------------------------------------
# Sinusoidal

def test_sinusoidal_matches_formula():
  t, dim = np.arange(7.0), 10
  expected = np.zeros((7, dim))
  for i in range(dim // 2):
    expected[:, 2 * i] = np.sin(t / 10000 ** (2 * i / dim))
    expected[:, 2 * i + 1] = np.cos(t / 10000 ** (2 * i / dim))
  np.testing.assert_allclose(sinusoidal(t, dim), expected, atol=1e-5)


@FAST
@hypothesis.given(offset=st.integers(0, 50))
def test_sinusoidal_dot_product_depends_only_on_offset(offset):
  starts = jnp.array([0, 3, 40, 500])
  dots = jnp.sum(sinusoidal(starts, 32) * sinusoidal(starts + offset, 32), axis=-1)
  np.testing.assert_allclose(dots, jnp.full_like(dots, dots[0]), atol=1e-3)


def test_sinusoidal_shift_is_a_pairwise_rotation_fixed_by_the_offset():
  dim, offset = 16, 5
  angles = offset * 10000.0 ** (-np.arange(0, dim, 2) / dim)  # [dim/2]
  # (sin a, cos a) -> (sin(a + b), cos(a + b)) is the matrix [[cos b, sin b], [-sin b, cos b]].
  rotations = np.stack([np.stack([np.cos(angles), np.sin(angles)], -1),
                        np.stack([-np.sin(angles), np.cos(angles)], -1)], -2)  # [dim/2, 2, 2]
  for t in (0, 7, 123):
    pairs = np.asarray(sinusoidal(jnp.array(t), dim)).reshape(dim // 2, 2)
    shifted = np.asarray(sinusoidal(jnp.array(t + offset), dim)).reshape(dim // 2, 2)
    np.testing.assert_allclose(np.einsum("pij, pj -> pi", rotations, pairs), shifted, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# 1D RoPE

@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_rope_score_depends_only_on_offset(layout):
  q, k = _normal(0, (1, 1, 2, 16)), _normal(1, (1, 1, 2, 16))

  def score(m, n):
    return _score(rope(q, jnp.array([[m]]), layout=layout), rope(k, jnp.array([[n]]), layout=layout))

  np.testing.assert_allclose(score(3, 7), score(103, 107), rtol=1e-4, atol=1e-4)
  assert np.all(np.abs(score(3, 7) - score(3, 8)) > 1e-3)


@FAST
@hypothesis.given(batch=st.integers(1, 3), length=st.integers(1, 5), head_dim=st.sampled_from([2, 8, 12]),
                  layout=st.sampled_from(["split", "interleaved"]))
def test_rope_preserves_norms(batch, length, head_dim, layout):
  x = _normal(2, (batch, length, 2, head_dim))
  positions = np.random.default_rng(3).integers(0, 1000, (batch, length))
  np.testing.assert_allclose(jnp.linalg.norm(rope(x, positions, layout=layout), axis=-1),
                             jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_layouts_agree_up_to_a_fixed_permutation():
  x = _normal(4, (2, 5, 3, 12))
  positions = jnp.arange(10).reshape(2, 5) * 7
  # Interleaved pair (2i, 2i+1) is split pair (i, i + d/2): gather evens, then odds.
  to_split = np.concatenate([np.arange(0, 12, 2), np.arange(1, 12, 2)])
  np.testing.assert_allclose(rope(x[..., to_split], positions, layout="split"),
                             rope(x, positions, layout="interleaved")[..., to_split], atol=1e-5)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_partial_rotary_leaves_tail_untouched_and_rotates_head_as_full_rope(layout):
  x = _normal(5, (1, 4, 2, 16))
  positions = jnp.arange(4)[None] + 11
  out = rope(x, positions, rotary_dim=8, layout=layout)
  np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
  np.testing.assert_allclose(out[..., :8], rope(x[..., :8], positions, layout=layout), atol=1e-6)


def test_linear_scaling_at_scaled_position_equals_unscaled():
  x, factor = _normal(6, (1, 3, 2, 8)), 4.0
  positions = jnp.array([[1, 5, 30]])
  scaled = rope(x, positions * factor, scaling="linear", scaling_factor=factor)
  np.testing.assert_allclose(scaled, rope(x, positions), atol=1e-5)


def test_ntk_scaling_raises_base_by_factor_to_d_over_d_minus_2():
  x, factor, dim = _normal(7, (1, 3, 2, 8)), 8.0, 8
  positions = jnp.array([[1, 50, 3000]])
  ntk = rope(x, positions, scaling="ntk", scaling_factor=factor)
  np.testing.assert_allclose(ntk, rope(x, positions, base=10000.0 * factor ** (dim / (dim - 2))), atol=1e-5)
  assert not np.allclose(ntk, rope(x, positions), atol=1e-3)


def test_rope_angles_match_formula():
  positions = np.array([[0.0, 1.0, 17.0]])
  expected = positions[..., None] * 500.0 ** (-np.arange(0, 6, 2) / 6)
  np.testing.assert_allclose(P.rope_angles(positions, 6, 500.0), expected, rtol=1e-6)


def test_rope_matches_torch_llama_and_complex_formulations():
  import torch  # a test dependency (requirements-test.txt): missing, the test fails
  x = _normal(8, (2, 5, 3, 8))
  positions = jnp.arange(10).reshape(2, 5) * 3
  xt = torch.tensor(np.asarray(x), dtype=torch.float64)
  inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
  angles = torch.tensor(np.asarray(positions), dtype=torch.float64)[..., None, None] * inv_freq  # [b, t, 1, 4]
  # Llama (Hugging Face): x * cos + rotate_half(x) * sin with duplicated halves.
  cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
  rotate_half = torch.cat([-xt[..., 4:], xt[..., :4]], -1)
  np.testing.assert_allclose(rope(x, positions, layout="split"), (xt * cos + rotate_half * sin).numpy(),
                             atol=1e-5)
  # Meta's original Llama / RoFormer: adjacent channels as one complex number times e^{i angle}.
  as_complex = torch.view_as_complex(xt.reshape(2, 5, 3, 4, 2).contiguous()) * torch.polar(torch.ones_like(angles), angles)
  np.testing.assert_allclose(rope(x, positions, layout="interleaved"),
                             torch.view_as_real(as_complex).reshape(2, 5, 3, 8).numpy(), atol=1e-5)


def test_rope_computes_in_float32_and_returns_input_dtype():
  x = _normal(9, (1, 2, 1, 8), jnp.bfloat16)
  positions = jnp.array([[1000, 2001]])
  out = rope(x, positions)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, rope(x.astype(jnp.float32), positions).astype(jnp.bfloat16))


@pytest.mark.parametrize("apply, positions", [
    (lambda x, p: P.apply_rope_2d(x, p), jnp.array([[[3, 1000], [2001, 5]]])),
    (lambda x, p: P.apply_mrope(x, p, (2, 1, 1)), jnp.array([[[1000, 2001]], [[3, 7]], [[5, 9]]]))],
    ids=["apply_rope_2d", "apply_mrope"])
def test_the_other_rotary_ops_compute_in_float32_and_return_the_input_dtype(apply, positions):
  """The module docstring's promise for every apply_*: bfloat16 in, bfloat16 out, rotated at float32."""
  x = _normal(19, (1, 2, 1, 8), jnp.bfloat16)
  out = apply(x, positions)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, apply(x.astype(jnp.float32), positions).astype(jnp.bfloat16))


def test_rope_length_only_positions_broadcast_over_batch():
  x = _normal(10, (3, 4, 2, 8))
  np.testing.assert_array_equal(rope(x, jnp.arange(4)), rope(x, jnp.tile(jnp.arange(4), (3, 1))))


# ---------------------------------------------------------------------------------------------
# 2D and multimodal RoPE

@FAST
@hypothesis.given(row_offset=st.integers(-6, 6), column_offset=st.integers(-6, 6), shift=st.tuples(
    st.integers(0, 40), st.integers(0, 40)))
def test_rope_2d_score_depends_only_on_row_and_column_offsets(row_offset, column_offset, shift):
  q, k = _normal(11, (1, 1, 2, 16)), _normal(12, (1, 1, 2, 16))
  query_position = jnp.array([10, 10])
  key_position = query_position + jnp.array([row_offset, column_offset])

  def score(delta):
    return _score(rope_2d(q, (query_position + delta)[None, None]),
                  rope_2d(k, (key_position + delta)[None, None]))

  np.testing.assert_allclose(score(jnp.array(shift)), score(jnp.zeros(2, jnp.int32)), rtol=1e-4, atol=1e-4)


def test_rope_2d_refuses_positions_that_could_be_per_token_or_per_row():
  """positions [2, 2] meant one cell per row (batch 2) rotated x [2, 2, ...] as one cell per token, silently."""
  x = _normal(14, (2, 2, 1, 8))
  with pytest.raises(ValueError, match=r"positions\[2, 2\] could be .* pass \[1, length, 2\] or \[batch, 1, 2\]"):
    P.apply_rope_2d(x, jnp.array([[0, 0], [5, 7]]))
  per_row = jnp.array([[0, 0], [5, 7]])[:, None]  # [batch, 1, 2]: the spelt-out shape still rotates
  np.testing.assert_allclose(P.apply_rope_2d(x, per_row)[0], x[0], atol=1e-6)  # row 0 sits at the origin
  assert P.apply_rope_2d(x, jnp.array([5, 7])).shape == x.shape  # [2]: one cell for every token


def test_rope_2d_first_half_turns_with_row_second_half_with_column():
  x = _normal(13, (1, 6, 2, 16))
  positions = P.grid_positions(2, 3)[None] * 5  # [1, 6, 2]
  out = rope_2d(x, positions, layout="interleaved")
  np.testing.assert_allclose(out[..., :8], rope(x[..., :8], positions[..., 0], layout="interleaved"), atol=1e-6)
  np.testing.assert_allclose(out[..., 8:], rope(x[..., 8:], positions[..., 1], layout="interleaved"), atol=1e-6)


def test_mrope_with_equal_axes_equals_1d_rope():
  x = _normal(14, (2, 5, 3, 16))
  positions = jnp.arange(10).reshape(2, 5) * 9
  np.testing.assert_allclose(mrope(x, jnp.stack([positions] * 3), (2, 3, 3)), rope(x, positions),
                             atol=1e-6)


def test_mrope_matches_qwen2_vl_torch_formulation():
  import torch  # a test dependency (requirements-test.txt): missing, the test fails
  x = _normal(22, (1, 9, 2, 16))
  positions = P.mrope_position_ids([[("text", 2), ("image", (1, 2, 2)), ("text", 3)]])  # [3, 1, 9]
  sections = (2, 3, 3)
  inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
  angles = torch.tensor(positions, dtype=torch.float64)[..., None] * inv_freq  # [3, b, t, 8]
  cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [3, b, t, 16]
  # Qwen2-VL: split cos/sin into mrope_section * 2 chunks, chunk i reads axis i % 3.
  cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(list(sections) * 2, dim=-1))], -1)[:, :, None]
  sin = torch.cat([c[i % 3] for i, c in enumerate(sin.split(list(sections) * 2, dim=-1))], -1)[:, :, None]
  xt = torch.tensor(np.asarray(x), dtype=torch.float64)
  rotate_half = torch.cat([-xt[..., 8:], xt[..., :8]], -1)
  np.testing.assert_allclose(mrope(x, positions, sections), (xt * cos + rotate_half * sin).numpy(), atol=1e-5)


def test_mrope_width_positions_move_only_the_width_section():
  x = _normal(15, (1, 4, 2, 16))
  positions = jnp.stack([jnp.arange(4)[None]] * 3)  # [3, 1, 4]
  sections = (2, 3, 3)  # pairs 0-1 time, 2-4 height, 5-7 width; split pair i is channels i and i + 8
  moved = mrope(x, positions.at[2].add(7), sections) != mrope(x, positions, sections)
  width_channels = np.zeros(16, bool)
  width_channels[[5, 6, 7, 13, 14, 15]] = True
  assert np.all(np.any(moved, axis=(0, 1, 2)) == width_channels)


def test_mrope_position_ids_text_image_text_match_hand_worked_ids():
  ids = P.mrope_position_ids([[("text", 3), ("image", (1, 2, 3)), ("text", 2)]])
  # Text 0..2; image starts at 3: time 3, rows 3..4, columns 3..5; its max is 5, so text resumes at 6.
  expected = np.array([[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
                       [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
                       [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]])[:, None]
  np.testing.assert_array_equal(ids, expected)


def test_mrope_position_ids_merge_patches_and_pad_shorter_examples():
  ids = P.mrope_position_ids([[("image", (2, 4, 2))], [("text", 2)]], spatial_merge_size=2, pad_to=5,
                             pad_position=-1)
  # (2, 4, 2) patches merged 2x2 -> 2 frames of a 2 x 1 grid = 4 tokens.
  expected = np.array([[[0, 0, 1, 1, -1], [0, 1, -1, -1, -1]],
                       [[0, 1, 0, 1, -1], [0, 1, -1, -1, -1]],
                       [[0, 0, 0, 0, -1], [0, 1, -1, -1, -1]]])
  np.testing.assert_array_equal(ids, expected)


# ---------------------------------------------------------------------------------------------
# 2D tables: sincos, Fourier features, grids

def test_grid_positions_are_row_major():
  np.testing.assert_array_equal(P.grid_positions(2, 3), [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]])


def test_normalized_grid_spans_minus_one_to_one():
  grid = P.normalized_grid(3, 5)
  chex.assert_shape(grid, (15, 2))
  np.testing.assert_allclose(grid[np.array([0, 2, 14])], [[-1, -1], [-1, 0], [1, 1]], atol=1e-7)


def test_sincos_2d_shape_and_range():
  table = P.sincos_2d((3, 4), 16)
  chex.assert_shape(table, (12, 16))
  assert np.all(np.abs(table) <= 1.0)
  # A tuple of integers is the grid whatever the integer type; a list or array is one position.
  np.testing.assert_array_equal(P.sincos_2d((np.int64(3), 4), 16), table)
  chex.assert_shape(P.sincos_2d([3, 4], 16), (16,))


def test_sincos_2d_hand_checked_entry():
  # dim 8: rows use channels 0-3, columns 4-7; frequencies 1 and 10000^(-1/2) = 0.01.
  row, column = 2.0, 3.0
  expected = [math.sin(row), math.cos(row), math.sin(0.01 * row), math.cos(0.01 * row),
              math.sin(column), math.cos(column), math.sin(0.01 * column), math.cos(0.01 * column)]
  np.testing.assert_allclose(P.sincos_2d(jnp.array([row, column]), 8), expected, atol=1e-6)
  np.testing.assert_allclose(P.sincos_2d((3, 4), 8)[2 * 4 + 3], expected, atol=1e-6)


def test_fourier_features_shape_range_and_raw_coords_first():
  coords = P.normalized_grid(4, 6)
  features = fourier_features(coords, num_bands=5, max_resolution=(4, 6))
  chex.assert_shape(features, (24, 2 + 2 * 2 * 5))
  np.testing.assert_array_equal(features[:, :2], coords)
  assert np.all(np.abs(features) <= 1.0)
  chex.assert_shape(fourier_features(coords, 5, 6, concat_pos=False), (24, 20))


def test_fourier_features_match_formula():
  coords = np.array([[0.25, -0.5]])
  bands = [np.linspace(1, 8 / 2, 3), np.linspace(1, 12 / 2, 3)]
  phases = np.pi * np.concatenate([coords[0, 0] * bands[0], coords[0, 1] * bands[1]])
  expected = np.concatenate([coords[0], np.sin(phases), np.cos(phases)])
  np.testing.assert_allclose(fourier_features(coords, 3, (8, 12))[0], expected, atol=1e-6)


def test_fourier_band_repeats_after_its_period():
  # Band f has period 2 / f in x: features at x and x + 2/f agree for that band.
  num_bands, resolution = 4, 16
  frequencies = np.linspace(1, resolution / 2, num_bands)
  x = jnp.array([[-0.3]])
  for band, frequency in enumerate(frequencies):
    a = fourier_features(x, num_bands, resolution, concat_pos=False)
    b = fourier_features(x + 2.0 / frequency, num_bands, resolution, concat_pos=False)
    np.testing.assert_allclose(a[0, np.array([band, num_bands + band])], b[0, np.array([band, num_bands + band])], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Resizing learned 2D tables

@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_resize_at_unchanged_grid_returns_table_exactly(method):
  table = _normal(16, (1 + 3 * 5, 4))
  assert P.resize_2d_table(table, (3, 5), (3, 5), method, num_extra_tokens=1) is table


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align_corners", [True, False])
def test_resize_to_non_square_grid_keeps_class_rows(method, align_corners):
  table = _normal(17, (2 + 4 * 4, 6))
  resized = resize(table, (4, 4), (3, 7), method, num_extra_tokens=2, align_corners=align_corners)
  chex.assert_shape(resized, (2 + 3 * 7, 6))
  np.testing.assert_array_equal(resized[:2], table[:2])


@pytest.mark.parametrize("old_grid, new_grid", [((3, 4), (7, 5)), ((5, 6), (3, 2)), ((1, 4), (3, 7))])
def test_bilinear_resize_of_a_linear_table_stays_linear(old_grid, new_grid):
  def linear(grid):  # value 2 * row + 3 * column + 1 at coordinates stretched to the old grid's extent
    rows = np.linspace(0, old_grid[0] - 1, grid[0]) if old_grid[0] > 1 else np.zeros(grid[0])
    columns = np.linspace(0, old_grid[1] - 1, grid[1])
    return (2 * rows[:, None] + 3 * columns[None, :] + 1).reshape(-1, 1)

  resized = resize(linear(old_grid), old_grid, new_grid, "bilinear")
  np.testing.assert_allclose(resized, linear(new_grid), atol=1e-4)


@pytest.mark.parametrize("method", ["bilinear", "bicubic"])
def test_resize_to_refined_grid_keeps_values_at_original_grid_points(method):
  # With aligned corners, a (h, w) -> (2h - 1, 2w - 1) resize puts every other new cell on an old cell.
  table = _normal(18, (3 * 4, 5))
  resized = resize(table, (3, 4), (5, 7), method).reshape(5, 7, 5)
  np.testing.assert_allclose(resized[::2, ::2], table.reshape(3, 4, 5), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Learned absolute lookup

def test_learned_lookup_reads_table_rows():
  table = _normal(19, (10, 4))
  positions = jnp.array([[0, 9, 3]])
  np.testing.assert_array_equal(P.learned_lookup(table, positions), table[positions])


@pytest.mark.parametrize("bad_position", [10, -1])
def test_learned_lookup_outside_table_raises(bad_position):
  with pytest.raises(ValueError, match="position"):
    P.learned_lookup(jnp.zeros((10, 4)), jnp.array([[0, bad_position]]))


def test_check_positions_fit_raises_beyond_table():
  P.check_positions_fit(9, 10)
  with pytest.raises(ValueError, match="10 rows"):
    P.check_positions_fit(10, 10)


def test_learned_lookup_jits_without_retracing():
  lookup = jax.jit(chex.assert_max_traces(P.learned_lookup, n=1))
  table = _normal(20, (10, 4))
  first = lookup(table, jnp.array([[1, 2]]))
  second = lookup(table, jnp.array([[7, 3]]))
  chex.clear_trace_counter()
  np.testing.assert_array_equal(jnp.concatenate([first, second]), table[jnp.array([[1, 2], [7, 3]])])


def test_learned_lookup_checks_the_positions_a_jitted_function_closes_over():
  """Known while tracing, they are checked; the check computed on them with jnp, whose ops inside the jit
  returned tracers: every closed-over position array ended in a ConcretizationTypeError."""
  table = _normal(21, (10, 4))
  inside, outside = jnp.array([[1, 9]]), jnp.array([[1, 10]])
  np.testing.assert_array_equal(jax.jit(lambda t: P.learned_lookup(t, inside))(table), table[inside])
  with pytest.raises(ValueError, match="position"):
    jax.jit(lambda t: P.learned_lookup(t, outside))(table)


def test_learned_lookup_under_jit_gives_nan_rows_outside_table():
  out = jax.jit(P.learned_lookup)(jnp.ones((10, 4)), jnp.array([3, 10, -1]))
  assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1:]))


# ---------------------------------------------------------------------------------------------
# ALiBi and T5 relative biases

@FAST
@hypothesis.given(shift=st.integers(-20, 20), causal=st.booleans())
def test_alibi_bias_depends_only_on_offset(shift, causal):
  slopes = R.alibi_slopes(4)
  queries, keys = jnp.arange(3)[None] + 5, jnp.arange(6)[None]
  np.testing.assert_allclose(alibi_bias(queries + shift, keys + shift, slopes, causal=causal),
                             alibi_bias(queries, keys, slopes, causal=causal), atol=1e-5)


def test_alibi_bias_is_minus_slope_times_distance():
  bias = alibi_bias(jnp.array([[4]]), jnp.array([[0, 2, 4, 7]]), jnp.array([0.5, 0.25]))
  np.testing.assert_allclose(bias[0, :, 0], [[-2.0, -1.0, 0.0, -1.5], [-1.0, -0.5, 0.0, -0.75]])
  causal = alibi_bias(jnp.array([[4]]), jnp.array([[0, 2, 4, 7]]), jnp.array([0.5]), causal=True)
  np.testing.assert_allclose(causal[0, 0, 0], [-2.0, -1.0, 0.0, 1.5])


def test_alibi_slopes_match_paper_for_8_heads():
  np.testing.assert_allclose(R.alibi_slopes(8), [2.0 ** -k for k in range(1, 9)])


def test_alibi_slopes_non_power_of_two_interleave_the_next_power():
  # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other 8-head slope: 2^-1, 2^-3.
  np.testing.assert_allclose(R.alibi_slopes(6), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3])
  # 12 heads: the 8-head slopes, then 16-head slopes 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  np.testing.assert_allclose(R.alibi_slopes(12)[8:], [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5],
                             rtol=1e-6)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_small_offsets_have_their_own_bucket(bidirectional):
  before = t5_bucket(-jnp.arange(8), bidirectional=bidirectional)
  np.testing.assert_array_equal(before, np.arange(8))


@FAST
@hypothesis.given(distances=st.lists(st.integers(0, 400), min_size=2, max_size=8), bidirectional=st.booleans())
def test_t5_buckets_grow_monotonically_with_distance(distances, bidirectional):
  distances = np.sort(distances)
  buckets = np.asarray(t5_bucket(-jnp.array(distances), bidirectional=bidirectional))
  assert np.all(np.diff(buckets) >= 0)
  assert buckets.max() < (16 if bidirectional else 32)


def test_t5_bidirectional_halves_separate_keys_after_the_query():
  relative = jnp.arange(-300, 301)
  buckets = np.asarray(t5_bucket(relative, bidirectional=True))
  assert np.all((buckets >= 16) == (np.asarray(relative) > 0))
  np.testing.assert_array_equal(buckets[301:] - 16, buckets[299::-1])  # +d mirrors -d one half up


def test_t5_buckets_match_hand_computed_values():
  # 32 buckets, bidirectional: 16 per side, exact below 8, then 8 + floor(log(d/8)/log(16) * 8), capped at 15.
  relative = jnp.array([-3, 3, -8, -20, 20, -127, -128, -1000, 0])
  expected = [3, 19, 8, 10, 26, 15, 15, 15, 0]
  np.testing.assert_array_equal(t5_bucket(relative, bidirectional=True), expected)
  # Unidirectional: 32 buckets, exact below 16, then 16 + floor(log(d/16)/log(8) * 16); keys after the query -> 0.
  relative = jnp.array([5, -5, -16, -40, -127, -500])
  expected = [0, 5, 16, 23, 31, 31]
  np.testing.assert_array_equal(t5_bucket(relative, bidirectional=False), expected)


def test_t5_relative_bias_reads_table_at_the_bucket_of_each_offset():
  table = _normal(21, (32, 3))
  queries, keys = jnp.arange(4)[None], jnp.arange(6)[None] * 10
  bias = t5_relative_bias(queries, keys, table, bidirectional=False)
  chex.assert_shape(bias, (1, 3, 4, 6))
  buckets = t5_bucket(keys[0][None, :] - queries[0][:, None], bidirectional=False)
  np.testing.assert_array_equal(bias[0], jnp.moveaxis(table[buckets], -1, 0))


# ---------------------------------------------------------------------------------------------
# Validation: each bad input is a ValueError naming the argument

X = jnp.zeros((1, 4, 2, 8))
BAD_INPUTS = {
    "sinusoidal_odd_dim": (lambda: P.sinusoidal(jnp.arange(3), 7), "dim"),
    "rope_odd_rotary_dim": (lambda: P.apply_rope(X, jnp.arange(4)[None], rotary_dim=5), "rotary_dim"),
    # rotary_dim left at its default: the message names x's last axis, which the caller did pass.
    "rope_odd_head_dim": (lambda: P.apply_rope(jnp.zeros((1, 4, 2, 7)), jnp.arange(4)[None]),
                          r"x's last axis \(head_dim\) must be a multiple of 2 .* got x\[1, 4, 2, 7\]"),
    "rope_2d_head_dim_not_multiple_of_4": (lambda: P.apply_rope_2d(jnp.zeros((1, 4, 2, 6)), jnp.zeros((1, 4, 2))),
                                           r"x's last axis \(head_dim\) must be a multiple of 4"),
    "rope_rotary_dim_too_large": (lambda: P.apply_rope(X, jnp.arange(4)[None], rotary_dim=10), "rotary_dim"),
    "rope_positions_wrong_length": (lambda: P.apply_rope(X, jnp.arange(5)[None]), "positions"),
    "rope_positions_bool": (lambda: P.apply_rope(X, jnp.ones((1, 4), bool)), "positions"),
    "rope_unknown_layout": (lambda: P.apply_rope(X, jnp.arange(4)[None], layout="halves"), "layout"),
    # base ** (-2i/dim) of a base <= 0 is inf or NaN: every rotated channel came back NaN.
    "rope_base_zero": (lambda: P.apply_rope(X, jnp.arange(4)[None], base=0.0), "base=0.0"),
    "mrope_negative_base": (lambda: P.apply_mrope(X, jnp.zeros((3, 1, 4)), [2, 1, 1], base=-1.0), "base"),
    "sinusoidal_negative_base": (lambda: P.sinusoidal(jnp.arange(3), 8, base=-10.0), "base"),
    "sincos_2d_zero_base": (lambda: P.sincos_2d((2, 2), 8, base=0), "sincos_2d: base"),
    "rope_unknown_scaling": (lambda: P.apply_rope(X, jnp.arange(4)[None], scaling="yarn"), "scaling"),
    "rope_x_without_heads": (lambda: P.apply_rope(jnp.zeros((4, 8)), jnp.arange(4)), "x"),
    "rope_2d_positions_without_pair": (lambda: P.apply_rope_2d(X, jnp.zeros((1, 4), jnp.int32)), "positions"),
    "rope_2d_rotary_dim_not_multiple_of_4": (lambda: P.apply_rope_2d(X, jnp.zeros((1, 4, 2)), rotary_dim=6),
                                             "rotary_dim"),
    "mrope_sections_not_adding_up": (lambda: P.apply_mrope(X, jnp.zeros((3, 1, 4)), [1, 1, 1]), "sections"),
    "mrope_positions_not_one_row_per_section": (lambda: P.apply_mrope(X, jnp.zeros((1, 4)), [2, 1, 1]), "positions"),
    "mrope_sections_one_int": (lambda: P.apply_mrope(X, jnp.zeros((3, 1, 4)), 4), "sections"),
    "mrope_ids_float_pad_to": (lambda: P.mrope_position_ids([[("text", 2)]], pad_to=3.0), "pad_to=3.0"),
    "mrope_ids_negative_pad_to": (lambda: P.mrope_position_ids([[]], pad_to=-1), "pad_to=-1"),
    "mrope_ids_float_pad_position": (lambda: P.mrope_position_ids([[("text", 1)], [("text", 2)]], pad_position=1.5),
                                     "pad_position=1.5"),
    "mrope_ids_unknown_segment": (lambda: P.mrope_position_ids([[("audio", 3)]]), "segments"),
    "mrope_ids_grid_not_divisible_by_merge": (
        lambda: P.mrope_position_ids([[("image", (1, 3, 4))]], spatial_merge_size=2), "spatial_merge_size"),
    "sincos_2d_dim_not_multiple_of_4": (lambda: P.sincos_2d((2, 2), 6), "dim"),
    "sincos_2d_positions_not_pairs": (lambda: P.sincos_2d(jnp.zeros((4, 3)), 8), "positions"),
    "fourier_resolution_count": (lambda: P.fourier_features(jnp.zeros((4, 2)), 3, (8, 8, 8)), "max_resolution"),
    "resize_table_not_matching_grid": (lambda: P.resize_2d_table(jnp.zeros((10, 4)), (3, 3), (4, 4)), "table"),
    "resize_unknown_method": (lambda: P.resize_2d_table(jnp.zeros((9, 4)), (3, 3), (4, 4), "nearest"), "method"),
    "learned_lookup_float_positions": (lambda: P.learned_lookup(jnp.zeros((4, 2)), jnp.array([0.5])), "positions"),
    "alibi_slopes_zero_heads": (lambda: R.alibi_slopes(0), "num_heads"),
    "alibi_positions_3d": (lambda: R.alibi_bias(jnp.zeros((1, 2, 3)), jnp.zeros((1, 3)), jnp.ones(2)),
                           "query_positions"),
    "t5_odd_bidirectional_buckets": (lambda: R.t5_relative_position_bucket(jnp.arange(3), bidirectional=True,
                                                                           num_buckets=30), "num_buckets"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_invalid_input_raises_value_error_naming_the_argument(case):
  call, argument = BAD_INPUTS[case]
  with pytest.raises(ValueError, match=argument):
    call()
