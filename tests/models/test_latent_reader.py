"""Properties of the latent readers (Perceiver, Q-Former), the ViT encoder and freezing it."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from xattn_jax.models import latent_reader, vit

WIDTH, HEADS, LATENTS = 32, 2, 8
POSITION_ENCODINGS = ("fourier", "sincos_2d", "learned_2d", "rope_2d", "none")


def make_perceiver(posenc="fourier", **options):
  sizes = dict(grid=(8, 8), width=WIDTH, num_latents=LATENTS, num_heads=HEADS, num_blocks=1, mlp_ratio=2)
  return latent_reader.Perceiver(num_classes=10, position_encoding=posenc, rngs=nnx.Rngs(0), **{**sizes, **options})


def make_qformer(connector="qformer"):
  encoder = vit.ViT(num_classes=10, grid=(8, 8), width=WIDTH, num_heads=HEADS, num_blocks=1, mlp_ratio=2,
                    rngs=nnx.Rngs(1))
  return latent_reader.QFormer(encoder, num_classes=10, connector=connector, num_queries=LATENTS, width=WIDTH,
                               num_heads=HEADS, num_blocks=2, mlp_ratio=2, rngs=nnx.Rngs(2))


def random_inputs(m, seed=0, batch=2, side=16):
  """Pixel features [b, m, 1] at random distinct cells of a side x side grid: positions [b, m, 2]."""
  keys = jax.random.split(jax.random.key(seed), 2)
  features = jax.random.normal(keys[0], (batch, m, 1))
  cells = jax.random.permutation(keys[1], side * side)[:m]
  positions = jnp.stack([cells // side, cells % side], axis=-1).astype(jnp.int32)
  return features, jnp.broadcast_to(positions, (batch, m, 2)), (side, side)


# Everything runs jitted: eager NNX modules compile every small op separately, which is slow.
@nnx.jit(static_argnames="grid")
def read(model, features, positions, valid=None, grid=(16, 16)):
  return model.read(model.embed_elements(features, positions, grid), positions, valid=valid)


@nnx.jit(static_argnames="grid")
def add_positions(position_module, x, grid):
  return position_module.add_to_inputs(x, grid=grid)


@pytest.mark.parametrize("m", [64, 256, 257])
def test_reader_returns_n_rows_whatever_the_number_of_inputs(m):
  model = make_perceiver()
  features, positions, grid = random_inputs(m, side=17)
  chex.assert_shape(read(model, features, positions, grid=grid), (2, LATENTS, WIDTH))


@pytest.mark.parametrize("posenc", POSITION_ENCODINGS)
def test_reader_is_a_set_function_of_feature_position_pairs(posenc):
  model = make_perceiver(posenc)
  features, positions, _ = random_inputs(48)
  permutation = jax.random.permutation(jax.random.key(7), 48)
  chex.assert_trees_all_close(read(model, features[:, permutation], positions[:, permutation]),
                              read(model, features, positions), atol=1e-5)


def test_masked_padding_inputs_change_nothing():
  model = make_perceiver("rope_2d")  # the padded keys carry rotated positions too
  features, positions, _ = random_inputs(40)
  extra_features, extra_positions, _ = random_inputs(24, seed=1)
  padded_features = jnp.concatenate([features, 100.0 * extra_features], axis=1)
  padded_positions = jnp.concatenate([positions, extra_positions], axis=1)
  valid = jnp.arange(64)[None, :].repeat(2, axis=0) < 40
  chex.assert_trees_all_close(read(model, padded_features, padded_positions, valid),
                              read(model, features, positions), atol=1e-5)


def test_repeats_share_the_latent_stack_weights():
  count = lambda model: sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count(make_perceiver(num_repeats=3)) == count(make_perceiver(num_repeats=1))


def test_learned_2d_table_is_added_exactly_on_the_training_grid():
  encoder = vit.ViT(num_classes=10, grid=(8, 8), width=WIDTH, num_heads=HEADS, num_blocks=1, rngs=nnx.Rngs(0))
  zeros = jnp.zeros((1, 1 + 64, WIDTH))
  added = add_positions(encoder.positions, zeros, (8, 8))
  np.testing.assert_array_equal(added[0], encoder.positions.table[...])


def test_learned_2d_resize_to_a_new_grid_keeps_the_class_row():
  encoder = vit.ViT(num_classes=10, grid=(8, 8), width=WIDTH, num_heads=HEADS, num_blocks=1, rngs=nnx.Rngs(0))
  added = add_positions(encoder.positions, jnp.zeros((1, 1 + 12 * 16, WIDTH)), (12, 16))
  np.testing.assert_array_equal(added[0, 0], encoder.positions.table[...][0])
  assert not np.allclose(added[0, 1:65], encoder.positions.table[...][1:])  # the grid rows did change


def test_qformer_hands_on_n_tokens_and_the_llava_connector_one_per_feature():
  images = jnp.zeros((2, 12, 12, 1))  # M = 1 + 144 encoder outputs (class token and patches)
  tokens = nnx.jit(lambda model, images: model.tokens(images))
  chex.assert_shape(tokens(make_qformer("qformer"), images), (2, LATENTS, WIDTH))
  chex.assert_shape(tokens(make_qformer("llava"), images), (2, 145, WIDTH))


@pytest.mark.parametrize("connector", ["qformer", "llava"])
def test_qformer_padded_features_change_nothing(connector):
  """Features padded from 10 to 16 rows with junk, marked invalid: the same logits as the 10 alone."""
  model = make_qformer(connector)
  features = jax.random.normal(jax.random.key(0), (2, 10, WIDTH))
  junk = 100.0 * jax.random.normal(jax.random.key(1), (2, 6, WIDTH))
  valid = jnp.arange(16)[None, :].repeat(2, axis=0) < 10

  @nnx.jit
  def logits(model, features, valid):
    return model.classify(*model.read(features, valid=valid))

  chex.assert_trees_all_close(logits(model, jnp.concatenate([features, junk], axis=1), valid),
                              logits(model, features, None), atol=1e-5)


def test_qformer_read_of_the_wrong_width_raises_naming_it():
  with pytest.raises(ValueError, match=rf"features must be \[batch, M, {WIDTH}\].*\[2, 5, 7\]"):
    make_qformer().read(jnp.zeros((2, 5, 7)))


def test_qformer_queries_cross_attend_every_other_block():
  model = make_qformer()
  assert [block.cross_attention is not None for block in model.blocks] == [True, False]


def _loss(model, images, labels):
  return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()


def test_no_gradient_reaches_the_frozen_encoder():
  model = make_qformer()
  images, labels = jax.random.normal(jax.random.key(0), (4, 8, 8, 1)), jnp.arange(4)
  everything = nnx.DiffState(0, nnx.Any(nnx.Param, latent_reader.FrozenParam))
  grads = nnx.jit(nnx.grad(_loss, argnums=everything))(model, images, labels)
  encoder_grads = jax.tree.leaves(grads["encoder"])
  assert encoder_grads and all(not np.any(g) for g in encoder_grads)
  assert any(np.any(g) for g in jax.tree.leaves(grads["queries"]))


def test_frozen_encoder_is_bit_for_bit_unchanged_by_training_steps():
  model = make_qformer()
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
  encoder_before = jax.tree.map(np.array, nnx.state(model.encoder, latent_reader.FrozenParam))
  queries_before = np.array(model.queries.queries[...])

  @nnx.jit
  def step(model, optimizer, images, labels):
    optimizer.update(model, nnx.grad(_loss)(model, images, labels))

  for seed in range(3):
    step(model, optimizer, jax.random.normal(jax.random.key(seed), (4, 8, 8, 1)), jnp.arange(4))
  chex.assert_trees_all_equal(jax.tree.map(np.array, nnx.state(model.encoder, latent_reader.FrozenParam)), encoder_before)
  assert not np.array_equal(model.queries.queries[...], queries_before)


def test_unknown_connector_raises_naming_it():
  encoder = vit.ViT(num_classes=10, width=WIDTH, num_heads=HEADS, num_blocks=1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="connector"):
    latent_reader.QFormer(encoder, num_classes=10, connector="resampler", width=WIDTH, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("num_queries", [0, 2.0, True])
def test_learned_queries_refuse_a_count_that_is_not_a_positive_int(num_queries):
  with pytest.raises(ValueError, match="LearnedQueries: num_queries must be a positive int"):
    latent_reader.LearnedQueries(num_queries, 4, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("make", [make_perceiver, lambda **o: vit.ViT(num_classes=10, rngs=nnx.Rngs(0), **o)])
@pytest.mark.parametrize("options, argument", [(dict(num_heads=0), "num_heads must be a positive int, got 0"),
                                               (dict(mlp_ratio=0), "mlp_ratio"), (dict(channels=0), "channels"),
                                               (dict(patch_size=2.0), "patch_size"), (dict(remat="all"), "remat")])
def test_vit_and_perceiver_sizes_are_checked_when_built(make, options, argument):
  with pytest.raises(ValueError, match=argument):
    make(**options)


@pytest.mark.parametrize("make", [make_perceiver, lambda: vit.ViT(num_classes=10, width=WIDTH, num_blocks=1,
                                                                 rngs=nnx.Rngs(0))])
def test_images_of_other_channels_than_the_model_reads_are_named(make):
  with pytest.raises(ValueError, match=r"channels=1\], got images\[1, 8, 8, 3\]"):
    make()(jnp.zeros((1, 8, 8, 3)))


@pytest.mark.parametrize("options, argument", [(dict(mlp_ratio=0), "mlp_ratio must be a positive int"),
                                               (dict(num_classes=0), "num_classes"),
                                               (dict(num_blocks=2.0), "num_blocks"),
                                               (dict(cross_attention_every=1.5), "cross_attention_every"),
                                               (dict(num_consumer_blocks=-1), "num_consumer_blocks")])
def test_qformer_sizes_are_checked_when_built(options, argument):
  encoder = vit.ViT(num_classes=10, width=WIDTH, num_heads=HEADS, num_blocks=1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=argument):
    latent_reader.QFormer(encoder, **{**dict(num_classes=10, width=WIDTH, num_heads=HEADS), **options},
                          rngs=nnx.Rngs(0))


def test_float_positions_are_refused_naming_them():
  with pytest.raises(ValueError, match=r"positions must be int \[batch, M, 2\]"):
    make_perceiver().read(jnp.zeros((2, 16, WIDTH)), jnp.zeros((2, 16, 2)))


def test_valid_mask_of_the_wrong_shape_raises_naming_it():
  features, positions, grid = random_inputs(16)
  with pytest.raises(ValueError, match="valid"):
    read(make_perceiver(), features, positions, jnp.ones((2, 15), bool))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_patch_valid_refuses_a_pixel_mask_that_is_not_bool(dtype):
  with pytest.raises(ValueError, match=r"pixel_valid must be bool .* got pixel_valid (float32|int32)\[1, 4, 4\]"):
    vit.patch_valid(jnp.full((1, 4, 4), 0.5).astype(dtype), 2)


@pytest.mark.parametrize("posenc", ["rope", "alibi", "sinusoidal"])
def test_perceiver_refuses_one_dimensional_position_encodings(posenc):
  with pytest.raises(ValueError, match="position_encoding"):
    make_perceiver(posenc)


def test_repeated_blocks_with_dropout_are_the_same_function_scanned_or_unrolled():
  """The unrolled stack wrote back no RNG counts: its second repeat reused the first's masks (the
  scanned one drew new ones), so the two layouts computed different functions."""
  images = jax.random.uniform(jax.random.key(0), (2, 4, 4, 1))
  outputs = []
  for scan in (False, True):
    model = latent_reader.Perceiver(num_classes=3, grid=(4, 4), width=8, num_latents=3, num_heads=2, num_blocks=1,
                                    num_repeats=2, dropout_rate=0.5, scan_layers=scan, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda model, images: model(images, deterministic=False))
    outputs.append([forward(model, images) for _ in range(2)])
  for unrolled, scanned in zip(*outputs):
    np.testing.assert_allclose(unrolled, scanned, atol=1e-5)
  assert not np.allclose(*outputs[0])  # and a second call draws other masks


@pytest.mark.parametrize("make", [lambda: make_perceiver("fourier", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
                                  lambda: vit.ViT(num_classes=10, grid=(8, 8), width=WIDTH, num_heads=HEADS,
                                                  num_blocks=1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                  rngs=nnx.Rngs(0))],
                         ids=["perceiver_fourier", "vit_learned_2d"])
def test_param_dtype_reaches_every_parameter_position_encodings_included(make):
  """A bfloat16-parameter run kept its position encodings' parameters (the Fourier projection, ViT's learned
  table) in float32, as were they never told param_dtype."""
  model = nnx.eval_shape(make)
  dtypes = {jax.tree_util.keystr(path): x.dtype for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
  assert {path: d for path, d in dtypes.items() if d != jnp.bfloat16} == {}
