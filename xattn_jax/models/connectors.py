"""The connectors of `vlm.VisionLanguageModel`: what turns a frozen image encoder's features into what a
frozen language model reads (the `vlm` module docstring says how the model lays them out in the text).

`CONNECTORS` is the one list of them, by name:

- "flamingo" (`FlamingoConnector`, Alayrac et al. 2022): gated cross-attention dense blocks that the model
  inserts before LM layers 0, k, 2k, ...; they read the features, or the latents of an optional Perceiver
  resampler (`memory`). It hands the LM no soft tokens.
- "qformer" (`QFormerConnector`, BLIP-2, Li et al. 2023): N learned queries read the features in Q-Former
  blocks and a linear maps them to the LM width: N soft tokens whatever the image's size.
- "llava" (`LlavaConnector`, LLaVA-1.5, Liu et al. 2023): Linear-GELU-Linear on every patch feature, one soft
  token per patch; with merge m > 1 on every m x m block of patches concatenated (Qwen2-VL's merger).

What the model, its task and its plots read of a connector class (none of them names a connector; `_Connector`
documents each): `prefix_tokens` (it hands the LM soft tokens, `tokens`, each placed by `slot_token`; else the LM
reads its `memory` through the gated `blocks` inserted before `layers`), `spatial` (its soft tokens sit on the
image's patch grid, `token_grid`, which M-RoPE positions and spatial merging need), `slots` (how many soft-token
slots an image takes in the text), `config_fields` and `own_fields` (the model config fields it reads, and those
only it reads), `attention_maps`, and the config hooks `check_config`, `reads`, `reader`, `reading_settings` and
`frozen_widths`. `register_connector` adds one; `positioned` gives the features with the connector's own
position encoding of the encoder's patch grid, one of `feature_position_encodings()`.

Shapes: features [B, 1 + P, w] (the class token, then P = gh * gw patches row-major), valid [B, 1 + P],
soft tokens [B, K, d_lm].
"""
from __future__ import annotations

import math

import einops
import jax.numpy as jnp
from flax import nnx

from xattn_jax import registry
from xattn_jax.layers import MLP, blocks
from xattn_jax.layers import positions as positions_lib
from xattn_jax.models import latent_reader
from xattn_jax.models import lm as lm_lib
from xattn_jax.ops import masks as masks_lib
from xattn_jax.ops.positions import _check_positive_int


ATTENTION_MAPS = ("queries", "text", None)  # what `_Connector.attention_maps` may name


def feature_position_encodings() -> tuple[str, ...]:
  """The encodings a connector may add to the features of the encoder's patch grid: the registry's grid
  encodings that are not rotary, read when called."""
  return tuple(n for n in positions_lib.names(layout="grid") if positions_lib.get(n).role != "rotary")


class _Connector(nnx.Module):
  """What every connector shares: its position encoding of the features' patch grid, and what the generic code
  (the model, the VLM task, its plots) reads of a connector class. A new connector subclasses it and sets each."""
  prefix_tokens: bool = True  # hands the LM soft tokens (`tokens`, `slot_token`), else gated layers (`memory`, ...)
  spatial: bool = False  # its soft tokens sit on the patch grid (`token_grid(grid, merge)`); model.spatial_merge
  # The model config fields (model.<field>, the model's keywords) it reads -> its constructor's keyword for each.
  config_fields: dict[str, str] = {}
  # The fields of config_fields that only it reads -> the bundled configs' value (configs/vlm_digits.py reads it
  # here). Another connector refuses any other value there: it would change nothing.
  own_fields: dict = {}
  # What `VisionLanguageModel.attention_maps` draws of it: "queries" (each soft token's cross-attention over the
  # features, `cross_attention_weights`), "text" (each text token's, through its gated layers) or None (none).
  attention_maps: str | None = None

  @staticmethod
  def slots(grid, fields) -> int:
    """How many soft-token slots an image of real patch grid (gh, gw) takes in the text; fields: the model's
    config (model.<field> as in config_fields, a mapping)."""
    raise NotImplementedError

  @classmethod
  def check_config(cls, model) -> tuple[str, object, str] | None:
    """What stops it being built from the model config `model` (`config.model`): None, or (the field, its value,
    what it needs), which the VLM task raises as a ConfigError."""
    return None

  @classmethod
  def reads(cls, field: str, model) -> bool:
    """Whether this connector reads its own field `field` under the model config `model`."""
    return field in cls.own_fields

  @classmethod
  def reader(cls, name: str, field: str) -> str:
    """Who reads its own field `field`, in a ConfigError's words (name: its name in CONNECTORS)."""
    return f"connector={name}"

  @classmethod
  def reading_settings(cls, model) -> str:
    """The model config fields that decide which of its own fields it reads, as a ConfigError's ", field=value"."""
    return ""

  @classmethod
  def frozen_widths(cls, model) -> tuple[str, ...]:
    """The frozen parts whose width its attention splits into model.num_heads heads: "lm" (the LM's d_model),
    "encoder" (the image encoder's)."""
    return ()

  def _init_feature_positions(self, name: str, feature_width: int, grid, *, param_dtype, rngs):
    if name not in feature_position_encodings():
      raise ValueError(f"{type(self).__name__}: feature_positions must be one of {feature_position_encodings()}, "
                       f"got feature_positions={name!r}")
    options = {} if name == "none" else dict(grid=tuple(grid), num_extra_tokens=1, param_dtype=param_dtype)
    self.feature_positions = positions_lib.make_position_encoding(name, features=feature_width, rngs=rngs,
                                                                  **options)

  def positioned(self, features, grid):
    """features [B, 1 + P, w] of the patch grid (gh, gw), P = gh * gw -> the same with their positions added."""
    return self.feature_positions.add_to_inputs(features, grid=tuple(grid))


def _resampler_keys(features, valid, latents):
  """What a resampler block's latents attend to: the features [B, M, w] then themselves [B, S, w] -> (keys
  [B, M + S, w], padding mask over them)."""
  key_valid = jnp.concatenate([valid, jnp.ones(latents.shape[:2], bool)], axis=1)
  return jnp.concatenate([features, latents], axis=1), masks_lib.padding_mask(key_valid)


class FlamingoConnector(_Connector):
  """Gated cross-attention dense blocks before LM layers 0, k, 2k, ... and an optional resampler."""
  prefix_tokens = False  # reads the image through inserted layers, not soft tokens
  config_fields = {"num_heads": "num_heads", "mlp_ratio": "mlp_ratio", "cross_attention_every": "cross_attention_every",
                   "num_latents": "num_latents", "resampler_blocks": "resampler_blocks"}
  # cross_attention_every k: a gated block before every k-th LM layer; num_latents: Perceiver-resampler latents (0 =
  # read the features; 32 lift exact match by 0.047: experiments/results/intel_xeon_amx/flamingo_resampler.md)
  own_fields = {"cross_attention_every": 1, "num_latents": 32, "resampler_blocks": 1}
  attention_maps = "text"

  def __init__(self, feature_width: int, lm: lm_lib.LanguageModel, *, num_heads: int, mlp_ratio: int,
               cross_attention_every: int = 1, num_latents: int = 0, resampler_blocks: int = 1,
               feature_positions: str = "none", feature_grid=None, dropout_rate: float = 0.0, dtype, param_dtype,
               rngs: nnx.Rngs):
    for name, value in (("num_heads", num_heads), ("mlp_ratio", mlp_ratio),
                        ("cross_attention_every", cross_attention_every), ("resampler_blocks", resampler_blocks)):
      _check_positive_int(value, "FlamingoConnector", name)
    if isinstance(num_latents, bool) or not isinstance(num_latents, int) or num_latents < 0:
      raise ValueError(f"FlamingoConnector: num_latents must be an int >= 0 (0 = no resampler), got {num_latents!r}")
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self._init_feature_positions(feature_positions, feature_width, feature_grid, param_dtype=param_dtype, rngs=rngs)
    self.layers = tuple(range(0, lm.num_layers, cross_attention_every))
    self.latents = (latent_reader.LearnedQueries(num_latents, feature_width, param_dtype=param_dtype, rngs=rngs)
                    if num_latents else None)
    self.resampler = nnx.List([
        latent_reader.ReaderBlock(feature_width, feature_width, num_heads, mlp_ratio * feature_width,
                                  dropout_rate=dropout_rate, **common)
        for _ in range(resampler_blocks if num_latents else 0)])
    self.resampler_norm = blocks.layer_norm(feature_width, **common) if num_latents else None
    self.blocks = nnx.List([
        blocks.GatedCrossAttentionBlock(lm.d_model, feature_width, num_heads, mlp_ratio * lm.d_model,
                                        dropout_rate=dropout_rate, **common)
        for _ in self.layers])

  @staticmethod
  def slots(grid, fields) -> int:
    return 0

  @classmethod
  def reads(cls, field: str, model) -> bool:
    return field in cls.own_fields and (field != "resampler_blocks" or model.num_latents > 0)

  @classmethod
  def reader(cls, name: str, field: str) -> str:
    return f"connector={name}" + (" with model.num_latents > 0 (its resampler)" if field == "resampler_blocks" else "")

  @classmethod
  def reading_settings(cls, model) -> str:
    return f", model.num_latents={model.num_latents}"

  @classmethod
  def frozen_widths(cls, model) -> tuple[str, ...]:
    return ("lm", "encoder") if model.num_latents else ("lm",)  # gated blocks at the LM's, resampler the encoder's

  def memory(self, features, valid, *, deterministic):
    """features [B, 1 + P, w], valid [B, 1 + P] -> (memory [B, S, w], memory_valid [B, S])."""
    if self.latents is None:
      return features, valid
    latents = self.latents(features.shape[0], features.dtype)  # [B, N, w]
    for block in self.resampler:  # Flamingo: the latents read the features and themselves
      keys, mask = _resampler_keys(features, valid, latents)
      latents = block(latents, keys, input_mask=mask, deterministic=deterministic)
    latents = self.resampler_norm(latents)
    return latents, jnp.ones(latents.shape[:2], bool)

  def feature_weights(self, features, valid):
    """features [B, 1 + P, w], valid [B, 1 + P] -> float32 [B, S, 1 + P]: how much of each memory row's attention
    reaches each feature through the resampler (needs num_latents > 0), composed through its blocks (mean over
    heads): R = F + L @ R_before, F and L a block's weights over the features and over the latents it starts from
    (R_before = 0 for the learned initial latents, which hold no image); the residual paths are not counted, so a
    row's mass is the share of its reading that came from the image."""
    if self.latents is None:
      raise ValueError("FlamingoConnector.feature_weights: without a resampler (num_latents=0) the memory rows are "
                       "the features themselves")
    m = features.shape[1]
    latents = self.latents(features.shape[0], features.dtype)
    reach = jnp.zeros((features.shape[0], latents.shape[1], m), jnp.float32)
    for block in self.resampler:
      keys, mask = _resampler_keys(features, valid, latents)
      weights = jnp.mean(block.cross_attention_weights(latents, keys, input_mask=mask), axis=1)  # [B, S, M + S]
      reach = weights[..., :m] + jnp.einsum("bst,btm->bsm", weights[..., m:], reach)
      latents = block(latents, keys, input_mask=mask, deterministic=True)
    return reach


class QFormerConnector(_Connector):
  """BLIP-2: N learned queries read the features in ReaderBlocks, then a linear to the LM width."""
  prefix_tokens = True
  config_fields = {"num_heads": "num_heads", "mlp_ratio": "mlp_ratio", "num_queries": "num_queries",
                   "qformer_width": "width", "qformer_blocks": "num_blocks",
                   "qformer_cross_attention_every": "cross_attention_every"}
  # N soft tokens per image (BLIP-2: 32); the Q-Former's width, blocks and cross-attention every k-th block
  own_fields = {"num_queries": 32, "qformer_width": 64, "qformer_blocks": 2, "qformer_cross_attention_every": 2}
  attention_maps = "queries"

  def __init__(self, feature_width: int, lm: lm_lib.LanguageModel, *, num_heads: int, mlp_ratio: int,
               num_queries: int = 32, width: int = 64, num_blocks: int = 2, cross_attention_every: int = 2,
               feature_positions: str = "none", feature_grid=None, dropout_rate: float = 0.0, dtype, param_dtype,
               rngs: nnx.Rngs):
    for name, value in (("num_heads", num_heads), ("mlp_ratio", mlp_ratio), ("num_blocks", num_blocks),
                        ("cross_attention_every", cross_attention_every)):
      _check_positive_int(value, "QFormerConnector", name)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self._init_feature_positions(feature_positions, feature_width, feature_grid, param_dtype=param_dtype, rngs=rngs)
    self.num_queries = num_queries
    self.queries = latent_reader.LearnedQueries(num_queries, width, param_dtype=param_dtype, rngs=rngs)
    self.blocks = nnx.List([
        latent_reader.ReaderBlock(width, feature_width, num_heads, mlp_ratio * width, self_attention=True,
                                  cross_attention=i % cross_attention_every == 0, dropout_rate=dropout_rate,
                                  **common)
        for i in range(num_blocks)])
    self.norm = blocks.layer_norm(width, **common)
    self.projection = latent_reader._linear(width, lm.d_model, ("embed", "embed"), **common)

  @staticmethod
  def slots(grid, fields) -> int:
    return fields["num_queries"]

  @classmethod
  def check_config(cls, model) -> tuple[str, object, str] | None:
    if model.qformer_width % model.num_heads:
      return ("model.num_heads", model.num_heads, f"must divide model.qformer_width={model.qformer_width}: the "
              "Q-Former's queries attend in these heads")
    return None

  def tokens(self, features, valid, *, grid, deterministic):
    """features [B, 1 + P, w], valid [B, 1 + P] -> soft tokens [B, N, d_lm] (N whatever the grid)."""
    mask = masks_lib.padding_mask(valid)
    x = self.queries(features.shape[0], features.dtype)
    for block in self.blocks:
      x = block(x, features if block.cross_attention is not None else None, input_mask=mask,
                deterministic=deterministic)
    return self.projection(self.norm(x))

  def slot_token(self, k, grid_width, canvas_width):
    """The index into `tokens`' K axis of an image's k-th soft token."""
    return k

  def cross_attention_weights(self, features, valid):
    """features [B, 1 + P, w], valid [B, 1 + P] -> float32 [B, C, heads, N, 1 + P]: each query's attention over
    the features in each of the C blocks that cross-attend, as `tokens` computes it."""
    mask = masks_lib.padding_mask(valid)
    x = self.queries(features.shape[0], features.dtype)
    weights = []
    for block in self.blocks:
      if block.cross_attention is not None:
        weights.append(block.cross_attention_weights(x, features, input_mask=mask))
      x = block(x, features if block.cross_attention is not None else None, input_mask=mask)
    return jnp.stack(weights, axis=1)


class LlavaConnector(_Connector):
  """LLaVA-1.5's projector: Linear-GELU-Linear on every patch feature, one LM token per patch; with merge
  m > 1, on every m x m block of patches concatenated (Qwen2-VL's merger), one LM token per block."""
  prefix_tokens = True
  spatial = True
  config_fields = {"spatial_merge": "merge"}

  def __init__(self, feature_width: int, lm: lm_lib.LanguageModel, *, merge: int = 1,
               feature_positions: str = "none", feature_grid=None, dropout_rate: float = 0.0, dtype, param_dtype,
               rngs: nnx.Rngs):
    self._init_feature_positions(feature_positions, feature_width, feature_grid, param_dtype=param_dtype, rngs=rngs)
    self.merge = merge
    self.projector = MLP(feature_width * merge * merge, lm.d_model, lm.d_model, activation="gelu",
                         dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  @staticmethod
  def token_grid(grid, merge: int) -> tuple[int, int]:
    """The soft-token grid of a patch grid (gh, gw): (ceil(gh / merge), ceil(gw / merge))."""
    return -(-grid[0] // merge), -(-grid[1] // merge)

  @staticmethod
  def slots(grid, fields) -> int:
    return math.prod(LlavaConnector.token_grid(grid, fields["spatial_merge"]))

  def tokens(self, features, valid, *, grid, deterministic):
    """features [B, 1 + P, w] of the canvas patch grid (gh, gw) -> soft tokens [B, K, d_lm], the canvas's
    patches (merge 1: K = P) or m x m blocks (K = ceil(gh / m) * ceil(gw / m)), row-major."""
    patches = features[:, 1:]
    if self.merge > 1:
      m = self.merge
      height, width = self.token_grid(grid, m)
      patches = patches.reshape(patches.shape[0], grid[0], grid[1], patches.shape[-1])
      patches = jnp.pad(patches, ((0, 0), (0, height * m - grid[0]), (0, width * m - grid[1]), (0, 0)))
      patches = einops.rearrange(patches, "b (h i) (w j) c -> b (h w) (i j c)", i=m, j=m)
    return self.projector(patches, deterministic=deterministic)

  def slot_token(self, k, grid_width, canvas_width):
    """The image's k-th soft token (row-major on its own token grid, grid_width wide) on the canvas's."""
    return (k // grid_width) * canvas_width + k % grid_width


CONNECTORS = {"flamingo": FlamingoConnector, "qformer": QFormerConnector, "llava": LlavaConnector}


def register_connector(name: str, connector: type, *, replace: bool = False) -> None:
  """Adds the connector class `connector` to CONNECTORS as `name`: the model, the VLM task and config validation
  accept it from then on (a subclass of `_Connector` that sets what its docstring lists; README "Add a
  connector"). Register it before the config is validated: a run of launch.py registers it from a module its
  config file imports. ValueError for a name that is not a non-empty str, or is registered already (unless
  replace), or a class that is not a `_Connector` subclass, or whose config_fields / own_fields do not fit."""
  registry.check_new_name("register_connector", CONNECTORS, name, replace=replace)
  if not isinstance(connector, type) or not issubclass(connector, _Connector):
    raise ValueError(f"register_connector: connector must be a subclass of connectors._Connector, got "
                     f"{connector!r}")
  if not set(connector.own_fields) <= set(connector.config_fields):
    raise ValueError(f"register_connector: {connector.__name__}.own_fields {sorted(connector.own_fields)} must be "
                     f"among its config_fields {sorted(connector.config_fields)}")
  if connector.attention_maps not in ATTENTION_MAPS:
    raise ValueError(f"register_connector: {connector.__name__}.attention_maps must be one of {ATTENTION_MAPS}, "
                     f"got {connector.attention_maps!r}")
  registry.add("register_connector", CONNECTORS, name, connector)


def config_defaults() -> dict:
  """Every registered connector's own fields with the bundled configs' value (`own_fields`), read when called."""
  return {field: value for connector in CONNECTORS.values() for field, value in connector.own_fields.items()}


def slots_per_image(connector: str, grid: tuple[int, int], fields) -> int:
  """How many `vlm.SOFT_TOKEN` slots `connector` gives an image whose real patch grid is grid = (gh, gw); fields:
  the model config (model.<field>: num_queries, spatial_merge, ..., a mapping)."""
  return CONNECTORS[connector].slots(tuple(grid), fields)
