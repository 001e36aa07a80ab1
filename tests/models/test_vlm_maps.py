"""Properties of VisionLanguageModel.attention_maps: probabilities over what each connector really reads."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.test_vlm import CANVAS, PATCH, batch_of, interleaved, make_images, make_vlm

GRID_PATCHES = (CANVAS[0] // PATCH) * (CANVAS[1] // PATCH)


@nnx.jit
def maps_of(model, images, pixel_valid, image_valid, tokens, valid):
  return model.attention_maps(images, pixel_valid, image_valid, tokens, valid)


def test_qformer_maps_are_each_querys_probabilities_over_the_real_features_of_its_image():
  model = make_vlm("qformer", hide_padding=True)
  images, pixel_valid, image_valid = make_images()
  tokens, valid = batch_of([interleaved(model)] * 2)
  maps = np.asarray(maps_of(model, images, pixel_valid, image_valid, tokens, valid))
  cross_blocks = sum(block.cross_attention is not None for block in model.connector.blocks)
  assert maps.shape == (2, 2, cross_blocks, 2, model.connector.num_queries, 1 + GRID_PATCHES)
  np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
  # Image 0 covers the left 2 x 2 patches of the 2 x 4 canvas: its padded patches get no attention.
  padded = np.array([c >= 2 for r in range(2) for c in range(4)])
  assert np.all(maps[:, 0, ..., 1:][..., padded] == 0.0)
  assert np.all(maps[:, 1, ..., 1:] > 0.0)


def test_flamingo_maps_put_each_tokens_attention_on_its_latest_image_only():
  model = make_vlm("flamingo", gates=0.5, hide_padding=True)
  images, pixel_valid, image_valid = make_images()
  tokens, valid = batch_of([interleaved(model)] * 2)
  maps = np.asarray(maps_of(model, images, pixel_valid, image_valid, tokens, valid))
  rows = 1 + GRID_PATCHES
  assert maps.shape == (2, len(model.connector.layers), 2, tokens.shape[1], 2 * rows)
  media = np.cumsum(np.asarray(tokens) == model.image_token_id, axis=1) - 1  # [b, T]: latest image, -1 none
  mass = maps.reshape(*maps.shape[:-1], 2, rows).sum(-1)  # -> [b, L, heads, T, image]
  for image in (0, 1):
    expected = (media == image).astype(np.float32)[:, None, None, :]
    np.testing.assert_allclose(mass[..., image], np.broadcast_to(expected, mass[..., image].shape), atol=1e-5)


def test_llava_has_no_attention_maps_and_says_why():
  model = make_vlm("llava")
  tokens, valid = batch_of([interleaved(model)] * 2)
  with pytest.raises(ValueError, match="llava.*self-attention"):
    model.attention_maps(*make_images(), tokens, valid)


def test_flamingo_maps_through_a_resampler_are_over_the_image_features():
  """With a resampler the gated layers read latents; the maps compose a token's weights over the latents with
  the latents' weights over the features, so they stay over the image (each row's mass <= its reading of it)."""
  model = make_vlm("flamingo", gates=0.5, hide_padding=True, num_latents=3)
  images, pixel_valid, image_valid = make_images()
  tokens, valid = batch_of([interleaved(model)] * 2)
  maps = np.asarray(maps_of(model, images, pixel_valid, image_valid, tokens, valid))
  rows = 1 + GRID_PATCHES
  assert maps.shape == (2, len(model.connector.layers), 2, tokens.shape[1], 2 * rows)
  media = np.cumsum(np.asarray(tokens) == model.image_token_id, axis=1) - 1
  mass = maps.reshape(*maps.shape[:-1], 2, rows).sum(-1)  # [b, L, heads, T, image]
  for image in (0, 1):
    reads = (media == image)[:, None, None, :]
    assert (mass[..., image][~np.broadcast_to(reads, mass[..., image].shape)] == 0).all()
    assert (mass[..., image][np.broadcast_to(reads, mass[..., image].shape)] > 0.05).all()
  assert (mass <= 1 + 1e-5).all()
  # one resampler block: a latent's reach is its attention over the features (the rest went to the latents)
  @nnx.jit
  def reach_and_direct(model, images, pixel_valid, image_valid):
    features, feature_valid, _ = model._features(images, pixel_valid, image_valid)
    reach = model.connector.feature_weights(features, feature_valid)
    block = model.connector.resampler[0]
    latents = model.connector.latents(features.shape[0], features.dtype)
    keys = jnp.concatenate([features, latents], axis=1)
    key_valid = jnp.concatenate([feature_valid, jnp.ones(latents.shape[:2], bool)], axis=1)
    return reach, block.cross_attention_weights(latents, keys, input_mask=key_valid[:, None, None, :])
  reach, direct = map(np.asarray, reach_and_direct(model, images, pixel_valid, image_valid))
  np.testing.assert_allclose(reach, direct.mean(1)[..., :rows], rtol=1e-5, atol=1e-6)
