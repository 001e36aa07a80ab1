"""The promptable segmenter: masks per prompt, padding, encode once / decode many, the frozen encoder."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers import Jitted
from xattn_jax.models import latent_reader, segmenter

SIZES = dict(patch_size=4, grid=(4, 4), encoder_width=16, encoder_heads=2, encoder_blocks=1, encoder_mlp_ratio=2,
             width=16, num_heads=2, num_blocks=1, mlp_features=32, num_masks=3, mask_features=8)


def _model(freeze=False, seed=0):
  return segmenter.Segmenter(freeze_encoder=freeze, **SIZES, rngs=nnx.Rngs(params=seed, dropout=seed))


@pytest.fixture(scope="module")
def model():
  return Jitted(_model())


def _images(batch, side=16, seed=0):
  return jax.random.uniform(jax.random.key(seed), (batch, side, side, 1))


def _clicks(rows_cols, labels):
  return jnp.asarray(rows_cols, jnp.float32), jnp.asarray(labels, jnp.int32)


@pytest.mark.parametrize("side", [16, 24, 32])
def test_one_set_of_masks_per_prompt_whatever_the_number_of_image_features(model, side):
  points, labels = _clicks([[[0.3, 0.6], [0.0, 0.0]]] * 2, [[1, 0]] * 2)
  masks, iou = model(_images(2, side), points, labels)
  assert masks.shape == (2, 3, side, side) and iou.shape == (2, 3)
  assert np.all((np.asarray(iou) >= 0) & (np.asarray(iou) <= 1))


def test_padding_a_prompt_changes_nothing(model):
  images = _images(1)
  short = _clicks([[[0.3, 0.6]]], [[1]])
  padded = _clicks([[[0.3, 0.6], [0.9, 0.1], [0.2, 0.2]]], [[1, 0, 0]])
  for got, want in zip(model(images, *padded), model(images, *short)):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_prompts_of_different_lengths_share_a_batch(model):
  images = _images(2)
  batch = _clicks([[[0.3, 0.6], [0.0, 0.0]], [[0.5, 0.5], [0.7, 0.2]]], [[1, 0], [1, 2]])
  together = model(images, *batch)
  first = model(images[:1], *_clicks([[[0.3, 0.6]]], [[1]]))
  second = model(images[1:], *_clicks([[[0.5, 0.5], [0.7, 0.2]]], [[1, 2]]))
  for got, a, b in zip(together, first, second):
    np.testing.assert_allclose(got, jnp.concatenate([a, b]), atol=1e-5)


def test_the_order_of_prompt_points_does_not_matter(model):
  images = _images(1)
  forward = model(images, *_clicks([[[0.3, 0.6], [0.7, 0.2]]], [[1, 2]]))
  backward = model(images, *_clicks([[[0.7, 0.2], [0.3, 0.6]]], [[2, 1]]))
  for got, want in zip(backward, forward):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_encoding_once_and_decoding_two_prompts_equals_two_full_passes(model):
  images = _images(1, seed=3)
  prompts = [_clicks([[[0.3, 0.6], [0.0, 0.0]]], [[1, 0]]), _clicks([[[0.1, 0.1], [0.8, 0.9]]], [[3, 4]])]
  features = model.encode(images)
  for points, labels in prompts:
    for got, want in zip(model.decode(features, points, labels), model(images, points, labels)):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # two compiled programs: rounding may differ


def test_the_frozen_encoder_stays_bit_for_bit_unchanged_by_training():
  model = _model(freeze=True)
  frozen = lambda: jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model.encoder, latent_reader.FrozenParam)))
  before = frozen()
  assert not nnx.state(model.encoder, nnx.Param)  # every parameter of the ViT is frozen
  decoder_before = np.array(model.iou_head.layers[0].kernel[...])
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
  images, (points, labels) = _images(2), _clicks([[[0.3, 0.6]]] * 2, [[1]] * 2)
  targets = (images[..., 0] > 0.5).astype(jnp.float32)

  @nnx.jit
  def step(model, optimizer):
    def loss(model):
      masks, iou = model(images, points, labels)
      return optax.sigmoid_binary_cross_entropy(masks, targets[:, None]).mean() + jnp.mean(iou)
    optimizer.update(model, nnx.grad(loss)(model))

  for _ in range(3):
    step(model, optimizer)
  jax.tree.map(np.testing.assert_array_equal, frozen(), before)
  assert not np.array_equal(model.iou_head.layers[0].kernel[...], decoder_before)  # the rest did train


def test_a_point_batch_unlike_the_images_raises_naming_points(model):
  with pytest.raises(ValueError, match="points"):
    model.decode(model.encode(_images(2)), *_clicks([[[0.3, 0.6]]], [[1]]))


@pytest.mark.parametrize("size, argument", [(dict(num_masks=3.0), "num_masks must be a positive int, got 3.0"),
                                            (dict(mlp_features=0), "mlp_features"),
                                            (dict(num_point_labels=0), "num_point_labels")])
def test_bad_sizes_are_named_when_built(size, argument):
  with pytest.raises(ValueError, match=argument):
    segmenter.Segmenter(freeze_encoder=False, **{**SIZES, **size}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("label", [-1, 5])
def test_point_labels_outside_the_type_table_are_named(label):
  """A label past the table embedded as NaN and a negative one read as padding, both silently."""
  points, labels = _clicks([[[0.3, 0.6], [0.5, 0.5]]], [[1, label]])
  with pytest.raises(ValueError, match=rf"point_labels must be in \[0, num_point_labels=5\) .* from {min(label, 1)} "
                                       rf"to {max(label, 1)}"):
    _model().prompts(points, labels)
