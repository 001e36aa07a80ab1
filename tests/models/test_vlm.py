"""Properties of the vision-language model: frozen parts stay frozen, each connector reads what it should."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from xattn_jax.models import connectors, lm as lm_lib, vit, vlm
from xattn_jax.ops import positions as positions_ops

IMAGE, EOS, VOCAB = 3, 2, 24
PATCH, CANVAS = 4, (8, 16)  # a canvas of 2 x 4 patches; images of 8 x 8 (2 x 2) or 8 x 16 (2 x 4) pixels


def make_parts(position_encoding="rope"):
  encoder = vit.ViT(num_classes=3, patch_size=PATCH, grid=(2, 4), width=16, num_heads=2, num_blocks=1, mlp_ratio=2,
                    rngs=nnx.Rngs(0))
  lm = lm_lib.LanguageModel(vocab_size=VOCAB, d_model=32, num_heads=2, num_layers=2, mlp_dim=64,
                            position_encoding=position_encoding, max_length=64, rngs=nnx.Rngs(1))
  return encoder, lm


def make_vlm(connector, *, image_positions="sequence", gates=None, **options):
  encoder, lm = make_parts("mrope" if image_positions == "mrope" else "rope")
  defaults = dict(num_heads=2, mlp_ratio=2, num_queries=3, qformer_width=16, num_latents=0)
  model = vlm.VisionLanguageModel(encoder, lm, connector=connector, image_token_id=IMAGE,
                                  image_positions=image_positions, rngs=nnx.Rngs(2), **{**defaults, **options})
  if gates is not None:  # open flamingo's tanh gates so the image reaches the text
    for block in model.connector.blocks:
      for residual in (block.attention_residual, block.mlp_residual):
        residual.gate[...] = jnp.asarray(gates, jnp.float32)
  return model


def make_images(seed=0, batch=2):
  """Two images per row on the canvas: image 0 is 8 x 8 (top-left), image 1 fills it."""
  images = np.random.default_rng(seed).random((batch, 2, *CANVAS, 1)).astype(np.float32)
  pixel_valid = np.zeros((batch, 2, *CANVAS), bool)
  pixel_valid[:, 0, :, :8] = True
  pixel_valid[:, 1] = True
  images = np.where(pixel_valid[..., None], images, 0.0)
  return jnp.asarray(images), jnp.asarray(pixel_valid), jnp.ones((batch, 2), bool)


def layout(model, pieces):
  """Token ids of ("text", ids) / ("image", (h, w)) pieces: an image as its soft-token slots, then its marker."""
  ids = []
  for kind, value in pieces:
    ids += list(value) if kind == "text" else [vlm.SOFT_TOKEN] * model.slots_per_image(*value) + [IMAGE]
  return ids


def interleaved(model):
  return layout(model, [("text", [1, 5]), ("image", (8, 8)), ("text", [6, 7]), ("image", (8, 16)),
                        ("text", [8, 9, 10])])


@nnx.jit
def logits_of(model, images, pixel_valid, image_valid, tokens, valid):
  return model(images, pixel_valid, image_valid, tokens, valid)


@nnx.jit
def encode_images(model, images, pixel_valid, image_valid):
  """The model's ImageContext, as one compiled program (run eagerly, each op compiles on its own)."""
  return model.encode_images(images, pixel_valid, image_valid)


@nnx.jit
def recorded(model, images, pixel_valid, image_valid, tokens, valid):
  """The logits and the residual stream after each LM block the forward records."""
  hidden = []
  return model(images, pixel_valid, image_valid, tokens, valid, hidden=hidden), hidden


def batch_of(rows):
  tokens, valid = lm_lib.left_pad(rows)
  return jnp.asarray(tokens), jnp.asarray(valid)


@pytest.mark.parametrize("connector", sorted(connectors.CONNECTORS))
def test_training_changes_only_the_connector(connector):
  model = make_vlm(connector, gates=0.5 if connector == "flamingo" else None)
  images = make_images()
  tokens, valid = batch_of([interleaved(model)] * 2)
  frozen_before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, vlm.latent_reader.FrozenParam)))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer):
    def loss_fn(model):
      logits = model(*images, tokens, valid)
      return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))(model)
    optimizer.update(model, grads)
    return grads

  for _ in range(2):
    grads = train_step(model, optimizer)
  assert set(nnx.to_pure_dict(grads)) == {"connector"}
  assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
  frozen_after = nnx.to_pure_dict(nnx.state(model, vlm.latent_reader.FrozenParam))
  assert set(frozen_after) == {"encoder", "lm"}
  jax.tree.map(np.testing.assert_array_equal, frozen_before, jax.tree.map(np.asarray, frozen_after))


def test_flamingo_with_closed_gates_is_the_frozen_lm_bit_for_bit():
  model = make_vlm("flamingo", num_latents=4)
  tokens, valid = batch_of([interleaved(model)] * 2)
  expected = nnx.jit(lambda lm, t: lm(t))(model.lm, tokens)
  np.testing.assert_array_equal(logits_of(model, *make_images(), tokens, valid), expected)


def test_flamingo_an_image_reaches_no_token_before_its_marker():
  model = make_vlm("flamingo", gates=1.0)
  tokens, valid = batch_of([interleaved(model)] * 2)
  first, second = np.flatnonzero(np.asarray(tokens[0]) == IMAGE)
  images, pixel_valid, image_valid = make_images(seed=0)
  other, _, _ = make_images(seed=1)
  base = logits_of(model, images, pixel_valid, image_valid, tokens, valid)
  first_changed = logits_of(model, images.at[:, 0].set(other[:, 0]), pixel_valid, image_valid, tokens, valid)
  second_changed = logits_of(model, images.at[:, 1].set(other[:, 1]), pixel_valid, image_valid, tokens, valid)
  np.testing.assert_array_equal(base[:, :first], first_changed[:, :first])
  assert not np.allclose(base[:, first:second], first_changed[:, first:second])
  np.testing.assert_array_equal(base[:, :second], second_changed[:, :second])
  assert not np.allclose(base[:, second:], second_changed[:, second:])


@nnx.jit
def first_gated_layer(model, images, pixel_valid, image_valid, tokens, valid):
  """The first gated block's output on the token embeddings (before any LM layer mixes the tokens)."""
  context = model.encode_images(images, pixel_valid, image_valid)
  mask = model._memory_mask(model._media(tokens, valid), context.memory_image, context.memory_valid)
  insert = model._insert(model._project_memories(context), mask, True)
  x = model.lm.embed(tokens) * jnp.sqrt(float(model.lm.d_model))
  return x, insert[0](x)


def test_flamingo_tokens_read_only_their_latest_image():
  model = make_vlm("flamingo", gates=1.0, num_latents=4)
  tokens, valid = batch_of([interleaved(model)] * 2)
  first, second = np.flatnonzero(np.asarray(tokens[0]) == IMAGE)
  images, pixel_valid, image_valid = make_images(seed=0)
  other, _, _ = make_images(seed=1)
  x, base = first_gated_layer(model, images, pixel_valid, image_valid, tokens, valid)
  _, changed = first_gated_layer(model, images.at[:, 0].set(other[:, 0]), pixel_valid, image_valid, tokens, valid)
  # Image 0 is read from its marker up to the next image, by no token after that; nothing reads before it.
  assert not np.allclose(base[:, first:second], changed[:, first:second])
  np.testing.assert_array_equal(base[:, second:], changed[:, second:])
  # A token before any image reads none: the cross-attention adds nothing (only the gated MLP acts).
  _, no_images = first_gated_layer(model, images, pixel_valid, jnp.zeros_like(image_valid), tokens, valid)
  np.testing.assert_array_equal(base[:, :first], no_images[:, :first])


@pytest.mark.parametrize("canvas", [(8, 8), (8, 16), (16, 16)])
def test_qformer_hands_the_lm_n_tokens_whatever_m(canvas):
  model = make_vlm("qformer")
  arrays = (jax.ShapeDtypeStruct((2, 1, *canvas, 1), jnp.float32), jax.ShapeDtypeStruct((2, 1, *canvas), bool),
            jax.ShapeDtypeStruct((2, 1), bool))
  context = nnx.eval_shape(lambda m, *a: m.encode_images(*a), model, *arrays)  # shapes only: nothing compiles
  assert context.tokens.shape == (2, 1, 3, 32)
  assert model.slots_per_image(*canvas) == 3


@nnx.jit
def connector_tokens(connector, features, valid):
  return connector.tokens(features, valid, grid=(2, 4), deterministic=True)


def encoder_features(model):
  """The encoder's features of the full-canvas images [b, 1 + P, w] (each carries its position, added inside)."""
  images, pixel_valid, _ = make_images()
  patch_valid = vit.patch_valid(pixel_valid[:, 1], PATCH)
  return nnx.jit(lambda e, x, v: e.features(x, valid=v))(model.encoder, images[:, 1], patch_valid)


def test_qformer_permuting_features_with_their_positions_changes_nothing():
  model = make_vlm("qformer")
  features = model.connector.positioned(encoder_features(model), (2, 4))  # with the connector's positions too
  valid = jnp.ones(features.shape[:2], bool)
  permutation = np.random.default_rng(3).permutation(features.shape[1])
  np.testing.assert_allclose(connector_tokens(model.connector, features[:, permutation], valid[:, permutation]),
                             connector_tokens(model.connector, features, valid), atol=1e-5)


def test_the_connectors_feature_positions_tell_where_each_feature_sits():
  model = make_vlm("qformer")  # feature_positions="learned_2d", the default
  features = encoder_features(model)
  valid = jnp.ones(features.shape[:2], bool)
  swapped = features.at[:, 1].set(features[:, 2]).at[:, 2].set(features[:, 1])  # two patches trade places
  read = lambda f: connector_tokens(model.connector, model.connector.positioned(f, (2, 4)), valid)
  assert not np.allclose(read(swapped), read(features), atol=1e-5)


def test_llava_mrope_image_positions_are_mrope_position_ids():
  model = make_vlm("llava", image_positions="mrope")
  tokens, valid = batch_of([interleaved(model)])
  context = encode_images(model, *make_images(batch=1))
  expected = positions_ops.mrope_position_ids(
      [[("text", 2), ("image", (1, 2, 2)), ("text", 1 + 2), ("image", (1, 2, 4)), ("text", 1 + 3)]])
  np.testing.assert_array_equal(model.positions(tokens, valid, context), expected)


def test_llava_mrope_text_after_an_image_resumes_at_its_maximum_plus_one():
  model = make_vlm("llava", image_positions="mrope")
  tokens, valid = batch_of([layout(model, [("image", (8, 16)), ("text", [5, 6])])])
  images, pixel_valid, image_valid = make_images(batch=1)  # the row's first image: the 8 x 16 one
  context = encode_images(model, images[:, ::-1], pixel_valid[:, ::-1], image_valid)
  positions = np.asarray(model.positions(tokens, valid, context))[:, 0]  # [3, T]
  image_end = model.slots_per_image(8, 16)
  assert positions[:, image_end].tolist() == [positions[:, :image_end].max() + 1] * 3
  assert positions[:, image_end + 1].tolist() == [positions[:, :image_end].max() + 2] * 3


def test_llava_spatial_merge_makes_one_token_of_each_block_of_patches():
  model = make_vlm("llava", spatial_merge=2)
  features = model.connector.positioned(encoder_features(model), (2, 4))  # [b, 1 + 8, w]: a 2 x 4 patch grid
  valid = jnp.ones(features.shape[:2], bool)
  tokens = connector_tokens(model.connector, features, valid)  # -> [b, 2, d_lm]: blocks (0, 1, 4, 5), (2, 3, 6, 7)
  patches = features[:, 1:]
  blocks = jnp.stack([patches[:, [0, 1, 4, 5]], patches[:, [2, 3, 6, 7]]], axis=1).reshape(2, 2, -1)
  project = nnx.jit(lambda m, x: m(x))
  np.testing.assert_allclose(tokens, project(model.connector.projector, blocks), atol=1e-6)
  # A side that is not a multiple of 2 ends in blocks holding padding: a 2 x 3 grid (its 6 patches are the
  # first 6 features here) gives 1 x 2 tokens, the second of patches 2 and 5 with zeros beside each.
  odd = nnx.jit(lambda c, f, v: c.tokens(f, v, grid=(2, 3), deterministic=True))(
      model.connector, features[:, :7], valid[:, :7])
  zeros = jnp.zeros_like(patches[:, 0])
  edge = jnp.concatenate([patches[:, 2], zeros, patches[:, 5], zeros], axis=-1)
  assert odd.shape[1] == 2
  np.testing.assert_allclose(odd[:, 1], project(model.connector.projector, edge), atol=1e-6)
  assert [model.slots_per_image(*size) for size in ((8, 8), (8, 16), (12, 12))] == [1, 2, 4]


def test_llava_spatial_merge_positions_are_mrope_position_ids_of_the_merged_grid():
  model = make_vlm("llava", image_positions="mrope", spatial_merge=2)
  tokens, valid = batch_of([interleaved(model)])
  context = encode_images(model, *make_images(batch=1))
  assert context.counts.tolist() == [[1, 2]] and context.tokens.shape[2] == 2
  expected = positions_ops.mrope_position_ids(
      [[("text", 2), ("image", (1, 1, 1)), ("text", 1 + 2), ("image", (1, 1, 2)), ("text", 1 + 3)]])
  np.testing.assert_array_equal(model.positions(tokens, valid, context), expected)


def test_spatial_merge_is_llava_only_and_positive():
  encoder, lm = make_parts()
  with pytest.raises(ValueError, match="spatial_merge merges the patches"):
    vlm.VisionLanguageModel(encoder, lm, connector="qformer", image_token_id=IMAGE, spatial_merge=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="spatial_merge must be a positive int, got spatial_merge=0"):
    vlm.VisionLanguageModel(encoder, lm, connector="llava", image_token_id=IMAGE, spatial_merge=0, rngs=nnx.Rngs(0))


def test_llava_mrope_on_text_only_is_the_1d_rope_lm():
  model = make_vlm("llava", image_positions="mrope")
  _, rope_lm = make_parts("rope")
  # The VLM's LM (mrope) holds the 1D-RoPE LM's weights: copy them over, then compare on text alone.
  weights = nnx.to_pure_dict(nnx.state(rope_lm, nnx.Param))
  frozen = nnx.state(model.lm, vlm.latent_reader.FrozenParam)
  nnx.replace_by_pure_dict(frozen, weights)
  nnx.update(model.lm, frozen)
  tokens, valid = batch_of([[1, 5, 6, 7, 8], [1, 9, 10, 11, 12]])
  np.testing.assert_array_equal(logits_of(model, *make_images(), tokens, valid),
                                nnx.jit(lambda lm, t: lm(t))(rope_lm, tokens))


@pytest.mark.parametrize("connector,image_positions,merge", [("flamingo", "sequence", 1), ("qformer", "sequence", 1),
                                                             ("llava", "mrope", 1), ("llava", "mrope", 2)])
def test_cached_generation_equals_the_full_forward_on_the_growing_prefix(connector, image_positions, merge):
  model = make_vlm(connector, image_positions=image_positions, gates=0.7 if connector == "flamingo" else None,
                   spatial_merge=merge)
  images = make_images()
  rows = [interleaved(model), layout(model, [("text", [1]), ("image", (8, 8))])]  # a prompt may end with an image
  prompt, prompt_valid = batch_of(rows)
  steps = 4

  @nnx.jit  # one program, one compile: the generation, then the full forward on its tokens
  def generate_and_rescore(model, images, pixel_valid, image_valid, prompt, prompt_valid):
    generated, scores = model.generate(images, pixel_valid, image_valid, prompt, prompt_valid, max_length=steps,
                                       eos_id=VOCAB + 1)
    full = jnp.concatenate([prompt, generated], axis=1)
    full_valid = jnp.concatenate([prompt_valid, jnp.ones(generated.shape, bool)], axis=1)
    return generated, scores, model(images, pixel_valid, image_valid, full, full_valid)

  generated, scores, logits = generate_and_rescore(model, *images, prompt, prompt_valid)
  logits = logits[:, prompt.shape[1] - 1:-1]  # -> [b, steps, vocab]
  # Each generated token is the full forward's greedy choice on the prefix before it, with its log-probability.
  np.testing.assert_array_equal(jnp.argmax(logits, axis=-1), generated)
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), generated[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(scores, log_probs.sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("connector,image_positions", [("flamingo", "sequence"), ("qformer", "sequence"),
                                                     ("llava", "mrope")])
def test_a_long_cache_decodes_its_first_half_on_that_half_with_the_same_tokens_and_scores(connector, image_positions):
  """decoding.py's promise for the VLM's cache (VLMCache.head keeps Flamingo's image memory and the latest image
  whole): a beam search over 64 positions with cache_halves gives what the whole cache gives."""
  from xattn_jax import decoding
  model = make_vlm(connector, image_positions=image_positions, gates=0.7 if connector == "flamingo" else None)
  nnx.update(model, jax.tree.map(lambda x: x * 3, nnx.state(model, nnx.Param)))  # sharper: varied beams
  images = make_images()
  prompt, prompt_valid = batch_of([interleaved(model), layout(model, [("text", [1]), ("image", (8, 8))])])
  # The search starts on the first half: the prefill fills the prompt but its last token. Shapes only (the
  # capacity is the cache's length): nothing compiles beyond the two searches.
  cache, _ = nnx.eval_shape(lambda m, *a: m.prefill(m.encode_images(*a[:3]), *a[3:], 64), model, *images, prompt,
                            prompt_valid)
  assert cache.capacity == 64 and prompt.shape[1] - 1 < 32
  def search(model, *arrays, cache_halves):
    options = decoding.DecodingOptions(method="beam", beam_size=3, cache_halves=cache_halves)
    return model.generate(*arrays, max_length=64 - prompt.shape[1], eos_id=VOCAB + 1, options=options)
  # Both searches in one program: one compile, not two.
  both = nnx.jit(lambda m, *a: (search(m, *a, cache_halves=True), search(m, *a, cache_halves=False)))
  (halves, halves_scores), (whole, whole_scores) = jax.tree.map(np.asarray, both(model, *images, prompt, prompt_valid))
  np.testing.assert_array_equal(halves, whole)
  np.testing.assert_allclose(halves_scores, whole_scores, rtol=1e-5, atol=1e-5)


def test_mrope_needs_an_mrope_lm_and_a_spatial_connector():
  encoder, lm = make_parts("rope")
  with pytest.raises(ValueError, match="a multimodal position encoding such as 'mrope'"):
    vlm.VisionLanguageModel(encoder, lm, connector="llava", image_token_id=IMAGE, image_positions="mrope",
                            rngs=nnx.Rngs(0))
  encoder, lm = make_parts("mrope")
  with pytest.raises(ValueError, match="image_positions"):
    vlm.VisionLanguageModel(encoder, lm, connector="qformer", image_token_id=IMAGE, image_positions="mrope",
                            rngs=nnx.Rngs(0))


@pytest.mark.parametrize("connector, options, argument", [
    ("qformer", dict(mlp_ratio=0), "QFormerConnector: mlp_ratio must be a positive int, got 0"),
    ("flamingo", dict(mlp_ratio=0), "FlamingoConnector: mlp_ratio"),
    ("flamingo", dict(cross_attention_every=1.5), "cross_attention_every"),
    ("flamingo", dict(num_latents=-1), "num_latents must be an int >= 0")])
def test_connector_sizes_are_checked_when_built(connector, options, argument):
  with pytest.raises(ValueError, match=argument):
    make_vlm(connector, **options)


def test_images_of_another_batch_than_the_text_are_refused():
  model = make_vlm("llava")  # the check is the connectors' shared positions(); llava ran on, broadcasting
  one_row = jnp.ones((1, 2), jnp.int32)  # the context of one row of two images (a generate given images[:1])
  context = vlm.ImageContext(counts=one_row, grid_height=one_row, grid_width=one_row)
  tokens, valid = batch_of([interleaved(model)] * 2)
  with pytest.raises(ValueError, match=r"need an image context of their batch 2, got images of batch 1"):
    model.prefill(context, tokens, valid, tokens.shape[1] + 2)


@pytest.mark.parametrize("connector, edit, have, counts", [
    ("qformer", lambda ids: ids[:2] + ids[3:], 5, [3, 3]),  # one of image 0's 3 slots missing
    ("qformer", lambda ids: ids + [vlm.SOFT_TOKEN], 7, [3, 3]),  # a slot past the last image's
    ("flamingo", lambda ids: ids + [vlm.SOFT_TOKEN], 1, [0, 0])])  # flamingo: an image is its marker alone
def test_tokens_whose_slots_cut_an_image_short_are_refused(connector, edit, have, counts):
  """A row one slot short handed image 0's soft tokens on to image 1's slots, and the model ran on."""
  model = make_vlm(connector)
  tokens, valid = batch_of([edit(interleaved(model))] * 2)
  with pytest.raises(ValueError, match=rf"tokens row 0 holds {have} SOFT_TOKEN slots, which end no image: its "
                                       rf"images take \{counts}"):
    model.positions(tokens, valid, encode_images(model, *make_images()))


def test_unknown_connector_raises_naming_it():
  encoder, lm = make_parts()
  with pytest.raises(ValueError, match="connector must be one of"):
    vlm.VisionLanguageModel(encoder, lm, connector="mlp", image_token_id=IMAGE, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("connector", sorted(connectors.CONNECTORS))
def test_forward_records_the_residual_after_each_lm_block_without_changing_the_logits(connector):
  model = make_vlm(connector, gates=0.5 if connector == "flamingo" else None)
  tokens, valid = batch_of([interleaved(model)] * 2)
  logits, hidden = recorded(model, *make_images(), tokens, valid)
  # two compiled programs (one with the states as outputs too) may fuse, and so round, differently
  np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_of(model, *make_images(), tokens, valid)),
                             rtol=1e-6, atol=1e-6)
  assert [h.shape for h in hidden] == [(2, tokens.shape[1], 32)] * model.lm.num_layers
  assert not np.allclose(np.asarray(hidden[0]), np.asarray(hidden[1]))


def test_with_closed_gates_flamingo_records_the_lm_states_of_its_text_alone():
  """At initialisation flamingo is the frozen LM: its states on a text equal `lm_hidden_states` of that text,
  so the description distillation of a text against itself is 0."""
  from xattn_jax.tasks.vlm import distillation
  model = make_vlm("flamingo")
  rows = [[1, 5, IMAGE, 6, 7, 8, EOS], [1, IMAGE, 9, 10, EOS, 0, 0]]
  tokens = jnp.asarray(rows)
  _, hidden = recorded(model, *make_images(), tokens, tokens != 0)
  text = nnx.jit(vlm.lm_hidden_states)(model.lm, tokens)
  valid = np.asarray(tokens != 0)
  for h, t in zip(hidden, text, strict=True):
    np.testing.assert_allclose(np.asarray(h)[valid], np.asarray(t)[valid], rtol=1e-5, atol=1e-5)
  target = jnp.stack(text, axis=2)
  assert float(distillation.description_distillation(hidden, target, tokens != 0)) < 1e-9
  assert float(distillation.description_distillation(hidden, target + 1.0, tokens != 0)) > 0.1
  with pytest.raises(ValueError, match="target must be"):
    distillation.description_distillation(hidden, target[:, :, :1], tokens != 0)
  with pytest.raises(ValueError, match="tokens must be int"):
    vlm.lm_hidden_states(model.lm, tokens.astype(jnp.float32))
