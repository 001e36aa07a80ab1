"""Translator speed: training throughput, FLOP/s, cached decoding, beam search, compile time.

Everything is measured in ONE process, side by side, so the ratios hold on a loaded machine:
  (a) training tokens/s (source + target, forward + backward + AdamW) against torch.nn.Transformer
      of identical size and batch (eager, CPU, torch threads = the cores JAX uses, AdamW(fused=True),
      and its default per-tensor AdamW as a labeled row), JAX at one step per call and at launch.py's
      default steps per call;
  (b) the achieved training FLOP/s as a fraction of a float32 2048^3 matmul's FLOP/s;
  (c) greedy decoding tokens/s: the cached jitted decoder against a cached torch decoder built from
      torch.nn.Transformer's own weights (asserted to decode the same tokens as torch.nn.Transformer
      re-running its decoder on the growing prefix, which stays as the no-cache row), eager and under
      torch.compile where that works; the once-projected cross-attention cache against projecting the
      memory's keys/values at every step; the decoder's kernels stored [out, in] (loop_step's default)
      against as trained, [in, out]; the same decoder tensor-parallel over --tensor_devices CPU devices
      (default: one per core; heads, MLP and vocabulary split, `sharding.place_model`); and the
      machine's limit for that work (FLOPs and bytes per step against this process's matmul rate and copy
      bandwidth, timed in the decoders' interleaved rounds);
  (d) beam search (beam 4) tokens/s, one device and tensor-parallel, against a cached torch beam search of
      the same algorithm;
  (e) compile time of the train step at 2, 6 and 12 layers per stack, with and without
      scan_layers, and the step time of both.
Times are medians of several runs after a warm-up, each ended by block_until_ready; what is compared
as a ratio (JAX vs torch training, scanned vs unrolled steps) runs interleaved, a, b, a, b, ...
Results go to experiments/results/translator_benchmark.{md,json}.

    python experiments/bench_translator.py           # the full sizes (several minutes)
    python experiments/bench_translator.py --quick   # a tiny smoke run
    python experiments/bench_translator.py --sections=decoding   # one section; the file keeps the others
    python experiments/bench_translator.py --sections=training --out=/tmp/a   # one section elsewhere; then
    python experiments/bench_translator.py --render /tmp/a/translator_benchmark.json /tmp/b/translator_benchmark.json
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from configs import common  # noqa: E402
from bench_common import (HostContention, interleaved_median_seconds, machine_limit_seconds,  # noqa: E402
                          machine_rate_probes, machine_rates, matmul_flops_per_second,
                          multi_step_call, parse_jax_vs_torch_args, run_record, tensor_parallel, write_results)
from xattn_jax import decoding  # noqa: E402
from xattn_jax.models import translator as translator_lib  # noqa: E402
from xattn_jax.training import trainer as trainer_lib  # noqa: E402

BOS = 1

FULL = dict(d_model=512, num_heads=8, num_layers=3, mlp_dim=2048, vocab=8000, batch=32, length=64,
            new_tokens=64, beam=4, repeats=7, compile_layers=(2, 6, 12))
QUICK = dict(d_model=64, num_heads=4, num_layers=2, mlp_dim=128, vocab=500, batch=4, length=16,
             new_tokens=8, beam=2, repeats=2, compile_layers=(1, 2))
# launch.py's default config.steps_per_call: how many training steps its jitted program runs per call.
STEPS_PER_CALL = common.base_config().steps_per_call


def tokens(rng, size, batch, length):
  # Ids >= 3 avoid pad / BOS / EOS, so no row has padding.
  return rng.integers(3, size, (batch, length)).astype(np.int32)


# --- JAX side -----------------------------------------------------------------------------------

def make_translator(s, num_layers=None, scan_layers=False, remat="none", seed=0):
  side = translator_lib.StackSize(s["d_model"], s["num_heads"], num_layers or s["num_layers"], s["mlp_dim"])
  return translator_lib.Translator(s["vocab"], encoder=side, decoder=side, position_encoding="sinusoidal",
                                   max_length=max(s["length"], s["new_tokens"]) + 1, scan_layers=scan_layers,
                                   remat=remat, rngs=nnx.Rngs(params=seed, dropout=seed))


def make_train_step(model, steps_per_call=None):
  """(state, inputs, decoder_inputs, targets) -> (state, loss) with AdamW, jitted over nnx.split
  state, state donated. With steps_per_call=K, the launcher's K-steps-per-call program instead:
  (state, batches, first_step, count, key) -> (state, {"loss": [K]}), batches stacked [K, ...]."""
  optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, inputs, decoder_inputs, targets):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      logits = model(inputs, decoder_inputs)  # -> [batch, length, vocab]
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  if steps_per_call is None:
    return jax.jit(train_step, donate_argnums=0), state

  def launcher_step(state, batch, step, rng_key):  # launch.py's step signature
    state, loss = train_step(state, *batch)
    return state, {"loss": loss}

  return jax.jit(trainer_lib.multi_step(launcher_step), donate_argnums=0), state


def jax_training(s, rng, steps_per_call=None):
  """A function running one call: one step, or `steps_per_call` steps in one jitted call."""
  model = make_translator(s)
  step, state = make_train_step(model, steps_per_call)
  if steps_per_call is None:
    holder = {"state": state}
    batch = [jnp.asarray(tokens(rng, s["vocab"], s["batch"], s["length"])) for _ in range(3)]

    def run():
      holder["state"], loss = step(holder["state"], *batch)
      loss.block_until_ready()

    return run
  batches = tuple(jnp.asarray(np.stack([tokens(rng, s["vocab"], s["batch"], s["length"])
                                        for _ in range(steps_per_call)])) for _ in range(3))
  return multi_step_call(step, state, batches, steps_per_call)


def decode_functions(model, s, logits_sharding=None):
  """Jitted greedy (cross-attention cache projected once), greedy re-projecting the memory every
  step, and beam search (candidates ranked where logits_sharding puts the vocabulary): each
  (inputs [b, s]) -> tokens."""
  graphdef, state = nnx.split(model)
  never_eos = s["vocab"]  # an id the model cannot emit, so every run decodes new_tokens steps
  common = dict(max_length=s["new_tokens"], bos_id=BOS, eos_id=never_eos)

  def start(state, inputs):
    model = nnx.merge(graphdef, state)
    memory = model.encode(inputs)  # -> [batch, source_length, d_model]
    return model, memory, model.init_cache(memory, inputs != 0, s["new_tokens"])

  @functools.partial(jax.jit, static_argnames="transpose_kernels")
  def greedy(state, inputs, transpose_kernels=True):
    model, _, cache = start(state, inputs)
    return decoding.greedy_search(model.loop_step(transpose_kernels=transpose_kernels), cache,
                                  batch_size=inputs.shape[0], **common).tokens

  @jax.jit
  def greedy_reprojecting(state, inputs):
    model, memory, cache = start(state, inputs)
    layers = model.decoder_layers()
    decode_step = model.loop_step()

    def step(tokens, cache):
      # Make the memory depend on the loop state, so XLA cannot hoist the projections out of the loop.
      memory_now = memory + jnp.zeros((), memory.dtype) * cache.position.astype(memory.dtype)
      fresh = tuple(c.replace(cross_attention=block.cross_attention.project_memory(memory_now))
                    for block, c in zip(layers, cache.layers))
      return decode_step(tokens, cache.replace(layers=fresh))

    return decoding.greedy_search(step, cache, batch_size=inputs.shape[0], **common).tokens

  @functools.partial(jax.jit, static_argnames="transpose_kernels")
  def beam(state, inputs, transpose_kernels=True):
    model, _, cache = start(state, inputs)
    return decoding.beam_search(model.loop_step(transpose_kernels=transpose_kernels), cache,
                                batch_size=inputs.shape[0], beam_size=s["beam"], alpha=0.6,
                                logits_sharding=logits_sharding, **common).tokens

  as_trained = dict(transpose_kernels=False)  # the decoder's kernels [in, out], beside loop_step's [out, in]
  return {name: (lambda inputs, f=f, kw=kw: f(state, inputs, **kw).block_until_ready())
          for name, f, kw in (("greedy", greedy, {}), ("greedy_reprojecting", greedy_reprojecting, {}),
                              ("greedy_kernels_in_out", greedy, as_trained), ("beam", beam, {}),
                              ("beam_kernels_in_out", beam, as_trained))}


def greedy_work(s):
  """FLOPs and bytes greedy decoding must move at the least: (encode FLOPs, [(FLOPs, bytes) per step]).

  Encoding and the memory's keys / values projection run once, over batch x source rows. Each step runs
  batch rows through every decoder layer (matmul FLOPs of the projections and MLP, attention over the
  cached keys and the memory) and the vocabulary projection; its bytes are every weight read once, the
  caches read (self-attention up to the step, the memory's keys / values) and this step's keys / values
  written, and the logits written and read once (float32).
  """
  d, f, n, v, b, src = s["d_model"], s["mlp_dim"], s["num_layers"], s["vocab"], s["batch"], s["length"]
  encode = 2 * b * src * (n * (4 * d * d + 2 * d * f + 2 * src * d) + n * 2 * d * d)  # + cross K/V once
  layer_weights, steps = 6 * d * d + 2 * d * f, []
  for t in range(s["new_tokens"]):
    keys = t + 1
    flops = 2 * b * (n * (layer_weights + 2 * keys * d + 2 * src * d) + d * v)
    floats = n * layer_weights + v * d + b * n * (2 * keys * d + 2 * src * d + 2 * d) + 2 * b * v
    steps.append((flops, 4 * floats))
  return encode, steps


def training_flops(s):
  """Matmul FLOPs of one training step (forward x 3), counting attention over all key positions."""
  d, f, n, v = s["d_model"], s["mlp_dim"], s["num_layers"], s["vocab"]
  src = tgt = s["length"]
  encoder_layer = src * (4 * d * d + 2 * d * f) + 2 * src * src * d
  decoder_layer = (tgt * (4 * d * d + 2 * d * f) + 2 * tgt * tgt * d   # self-attention and MLP
                   + tgt * 2 * d * d + src * 2 * d * d + 2 * tgt * src * d)  # cross-attention
  forward_macs = s["batch"] * (n * (encoder_layer + decoder_layer) + tgt * d * v)
  return 3 * 2 * forward_macs


def compile_and_step_times(s, rng):
  """Train-step compile seconds {(layers, scan): s} at each depth in s["compile_layers"], and the
  step seconds {scan: s} at the benchmark depth (unrolled vs scanned, same parameters' shapes)."""
  batch = [jnp.asarray(tokens(rng, s["vocab"], s["batch"], s["length"])) for _ in range(3)]
  compile_seconds, runs = {}, {}
  for layers in sorted(set(s["compile_layers"]) | {s["num_layers"]}):
    for scan in (False, True):
      step, state = make_train_step(make_translator(s, num_layers=layers, scan_layers=scan))
      start = time.perf_counter()
      compiled = step.lower(state, *batch).compile()
      compile_seconds[(layers, scan)] = time.perf_counter() - start
      print(f"  compile layers={layers} scan={scan}: {compile_seconds[(layers, scan)]:.2f} s", flush=True)
      if layers == s["num_layers"]:
        holder = {"state": state}

        def run(compiled=compiled, holder=holder):
          holder["state"], loss = compiled(holder["state"], *batch)
          loss.block_until_ready()

        runs[scan] = run
  # A scan stacks every layer's saved activations into [layers, ...] buffers (zero-filled, copied in,
  # then sliced out in the backward pass); a remat policy that saves fewer of them shrinks those
  # stacks. Measured as further interleaved variants: (scan, remat) -> step seconds.
  for scan, remat in ((True, "dots"), (True, "dots_no_batch"), (False, "dots_no_batch")):
    step, state = make_train_step(make_translator(s, scan_layers=scan, remat=remat))
    holder = {"state": state}

    def run_remat(compiled=step.lower(state, *batch).compile(), holder=holder):
      holder["state"], loss = compiled(holder["state"], *batch)
      loss.block_until_ready()

    runs[f"{'scan' if scan else 'unrolled'}_remat_{remat}"] = run_remat
  return compile_seconds, interleaved_median_seconds(runs, s["repeats"])


# --- torch side ---------------------------------------------------------------------------------

class TorchTranslator(torch.nn.Module):
  """torch.nn.Transformer with the same shape as the JAX model: pre-norm, ReLU, shared embedding
  scaled by sqrt(d_model), sinusoidal positions, tied output projection."""

  def __init__(self, s):
    super().__init__()
    d = s["d_model"]
    self.embed = torch.nn.Embedding(s["vocab"], d)
    torch.nn.init.normal_(self.embed.weight, std=d ** -0.5)
    self.transformer = torch.nn.Transformer(
        d, s["num_heads"], s["num_layers"], s["num_layers"], s["mlp_dim"], dropout=0.0, batch_first=True,
        norm_first=True)
    length = max(s["length"], s["new_tokens"]) + 1
    i = torch.arange(d // 2, dtype=torch.float32)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * 10000.0 ** (-2 * i / d)
    self.register_buffer("positions", torch.stack([angles.sin(), angles.cos()], -1).reshape(length, d))

  def _embed(self, ids):
    return self.embed(ids) * self.embed.embedding_dim ** 0.5 + self.positions[:ids.shape[1]]

  def encode(self, inputs):
    return self.transformer.encoder(self._embed(inputs))

  def decode(self, decoder_inputs, memory):
    mask = torch.nn.Transformer.generate_square_subsequent_mask(decoder_inputs.shape[1])
    x = self.transformer.decoder(self._embed(decoder_inputs), memory, tgt_mask=mask, tgt_is_causal=True)
    return x @ self.embed.weight.T  # -> [batch, length, vocab]

  def forward(self, inputs, decoder_inputs):
    return self.decode(decoder_inputs, self.encode(inputs))


def torch_training(s, rng, fused=True):
  """One torch training step; fused=True is AdamW's CPU fast path (its default is a loop over tensors)."""
  torch.manual_seed(0)
  model = TorchTranslator(s)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
  inputs, decoder_inputs, targets = (torch.from_numpy(tokens(rng, s["vocab"], s["batch"], s["length"])).long()
                                     for _ in range(3))

  def run():
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs, decoder_inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, s["vocab"]), targets.reshape(-1))
    loss.backward()
    optimizer.step()

  return run


def torch_greedy_rerun(model, new_tokens):
  """Greedy decoding with torch.nn.Transformer as it comes (no cache): every step re-runs the decoder on
  the whole prefix, re-projects the memory's keys / values and computes logits at every position.
  inputs [batch, source] -> tokens [batch, new_tokens]."""
  def run(inputs):
    with torch.inference_mode():
      memory = model.encode(inputs)
      prefix = torch.full((inputs.shape[0], 1), BOS, dtype=torch.long)
      for _ in range(new_tokens):
        logits = model.decode(prefix, memory)[:, -1]  # the whole prefix again -> [batch, vocab]
        prefix = torch.cat([prefix, logits.argmax(-1, keepdim=True)], dim=1)
    return prefix[:, 1:]

  return run


class TorchCachedDecoder:
  """A cached decoder built from a TorchTranslator's own weights: per token, the self-attention keys /
  values are appended to preallocated caches [rows, heads, capacity, head_dim], the memory's keys /
  values are projected once per sequence, and logits are computed for the new position only; attention
  is F.scaled_dot_product_attention. Computes what `model.decode` computes at the last position."""

  def __init__(self, model: TorchTranslator, capacity: int):
    self.model, self.capacity = model, capacity
    self.d = model.embed.embedding_dim
    self.heads = model.transformer.decoder.layers[0].self_attn.num_heads
    self.layers = list(model.transformer.decoder.layers)

  def start(self, inputs, repeat: int = 1):
    """Encodes inputs [batch, source] and returns the caches, each row repeated `repeat` times (beams).

    The memory's keys / values are projected once per source, then repeated for its beams."""
    memory = self.model.encode(inputs)  # -> [batch, source, d]
    rows = memory.shape[0] * repeat
    h, d = self.heads, self.d

    def split(x):  # [batch, source, d] -> [rows, heads, source, head_dim]
      return x.view(x.shape[0], -1, h, d // h).transpose(1, 2).repeat_interleave(repeat, dim=0).contiguous()

    cross = []
    for layer in self.layers:
      attn = layer.multihead_attn
      kv = F.linear(memory, attn.in_proj_weight[d:], attn.in_proj_bias[d:])  # -> [batch, source, 2 d]
      cross.append((split(kv[..., :d]), split(kv[..., d:])))
    own = [(torch.empty(rows, h, self.capacity, d // h), torch.empty(rows, h, self.capacity, d // h))
           for _ in self.layers]
    return {"self": own, "cross": cross}

  def step(self, tokens, position: int, cache):
    """tokens [rows] at `position` -> logits [rows, vocab]; writes this position's keys / values."""
    h, d = self.heads, self.d
    rows = tokens.shape[0]
    x = self.model.embed(tokens) * d ** 0.5 + self.model.positions[position]  # -> [rows, d]
    heads = lambda y: y.view(rows, h, 1, d // h)
    for layer, (keys, values), (memory_keys, memory_values) in zip(self.layers, cache["self"], cache["cross"]):
      attn = layer.self_attn
      q, k, v = F.linear(layer.norm1(x), attn.in_proj_weight, attn.in_proj_bias).view(rows, 3, h, d // h).unbind(1)
      keys[:, :, position], values[:, :, position] = k, v
      a = F.scaled_dot_product_attention(heads(q), keys[:, :, :position + 1], values[:, :, :position + 1])
      x = x + attn.out_proj(a.view(rows, d))
      attn = layer.multihead_attn
      q = F.linear(layer.norm2(x), attn.in_proj_weight[:d], attn.in_proj_bias[:d])
      a = F.scaled_dot_product_attention(heads(q), memory_keys, memory_values)
      x = x + attn.out_proj(a.view(rows, d))
      x = x + layer.linear2(F.relu(layer.linear1(layer.norm3(x))))
    x = self.model.transformer.decoder.norm(x)
    return F.linear(x, self.model.embed.weight)  # -> [rows, vocab]

  def reorder(self, cache, rows, filled: int):
    """Beam search: the self-attention caches' first `filled` positions take the rows `rows` [rows]."""
    for keys, values in cache["self"]:
      keys[:, :, :filled] = keys[:, :, :filled].index_select(0, rows)
      values[:, :, :filled] = values[:, :, :filled].index_select(0, rows)


def torch_greedy_cached(decoder: TorchCachedDecoder, new_tokens: int, step=None):
  """inputs [batch, source] -> tokens [batch, new_tokens]; step: decoder.step or a compiled one."""
  step = step or decoder.step

  def run(inputs):
    with torch.inference_mode():
      cache = decoder.start(inputs)
      token = torch.full((inputs.shape[0],), BOS, dtype=torch.long)
      out = []
      for position in range(new_tokens):
        token = step(token, position, cache).argmax(-1)
        out.append(token)
    return torch.stack(out, 1)

  return run


def torch_beam_cached(decoder: TorchCachedDecoder, new_tokens: int, beam_size: int, alpha: float, eos_id: int):
  """decoding.beam_search's algorithm (GNMT length penalty, 2 * beams candidates, finished hypotheses
  kept apart, early stop) over the cached torch decoder. inputs [batch, source] -> best beam's
  tokens [batch, new_tokens]."""
  k, length = beam_size, new_tokens
  penalty = lambda n: ((5.0 + n) / 6.0) ** alpha
  neg_inf = decoding.NEG_INF

  def run(inputs):
    with torch.inference_mode():
      b = inputs.shape[0]
      cache = decoder.start(inputs, repeat=k)
      live_tokens = torch.zeros(b, k, length, dtype=torch.long)
      live_scores = torch.tensor([0.0] + [neg_inf] * (k - 1)).repeat(b, 1)
      finished_tokens = torch.zeros(b, k, length, dtype=torch.long)
      finished_scores = torch.full((b, k), neg_inf)
      finished_any = torch.zeros(b, k, dtype=torch.bool)
      example_rows = torch.arange(b)[:, None] * k
      step = 0
      while step < length:
        worst_finished = torch.where(finished_any[:, -1], finished_scores[:, -1], neg_inf)
        if not bool((live_scores[:, 0] / penalty(length) > worst_finished).any()):
          break  # no live beam can beat the worst kept finished hypothesis
        last = torch.full((b * k,), BOS, dtype=torch.long) if step == 0 else live_tokens[:, :, step - 1].reshape(-1)
        log_probs = F.log_softmax(decoder.step(last, step, cache), -1)  # -> [batch * beams, vocab]
        vocab = log_probs.shape[-1]
        candidates = (live_scores[:, :, None] + log_probs.view(b, k, vocab)).view(b, k * vocab)
        top_scores, top_ids = candidates.topk(2 * k)  # -> [batch, 2 * beams]
        parent, token = top_ids // vocab, top_ids % vocab
        top_tokens = live_tokens.gather(1, parent[:, :, None].expand(-1, -1, length)).clone()
        top_tokens[:, :, step] = token
        is_eos = token == eos_id
        live_scores, live_rank = torch.where(is_eos, neg_inf, top_scores).topk(k)  # -> [batch, beams]
        live_tokens = top_tokens.gather(1, live_rank[:, :, None].expand(-1, -1, length))
        decoder.reorder(cache, (example_rows + parent.gather(1, live_rank)).reshape(-1), step + 1)
        new_finished = is_eos & (torch.arange(2 * k) < k) & (top_scores > neg_inf / 2)
        new_scores = torch.where(new_finished, top_scores / penalty(step + 1), neg_inf)
        finished_scores, keep = torch.cat([finished_scores, new_scores], 1).topk(k)
        finished_tokens = torch.cat([finished_tokens, top_tokens], 1).gather(1, keep[:, :, None].expand(-1, -1, length))
        finished_any = torch.cat([finished_any, new_finished], 1).gather(1, keep)
        step += 1
      live_scores = live_scores / penalty(step)
      rank_key = torch.cat([torch.where(finished_any, finished_scores, -float("inf")), live_scores + 2 * neg_inf], 1)
      best = rank_key.argmax(1)  # -> [batch]
      tokens = torch.cat([finished_tokens, live_tokens], 1)
    return tokens[torch.arange(b), best]

  return run


def compiled_step(decoder: TorchCachedDecoder, inputs, new_tokens: int):
  """(a greedy step for torch.compile, None) where it compiles and decodes eager's tokens; else (None, why).

  The compiled step has fixed shapes so that it compiles once: the position is a tensor, and attention
  runs over the cache's whole capacity with the positions not yet written masked out.
  """
  h, d, capacity = decoder.heads, decoder.d, decoder.capacity

  def fixed_shape_step(tokens, position, cache):  # tokens [rows], position: int64 0-d tensor
    rows = tokens.shape[0]
    model = decoder.model
    x = model.embed(tokens) * d ** 0.5 + model.positions.index_select(0, position[None])  # -> [rows, d]
    written = (torch.arange(capacity) <= position)[None, None, None, :]  # -> [1, 1, 1, capacity]
    heads = lambda y: y.view(rows, h, 1, d // h)
    for layer, (keys, values), (memory_keys, memory_values) in zip(decoder.layers, cache["self"], cache["cross"]):
      attn = layer.self_attn
      q, k, v = F.linear(layer.norm1(x), attn.in_proj_weight, attn.in_proj_bias).view(rows, 3, h, d // h).unbind(1)
      keys.index_copy_(2, position[None], k[:, :, None])
      values.index_copy_(2, position[None], v[:, :, None])
      a = F.scaled_dot_product_attention(heads(q), keys, values, attn_mask=written)
      x = x + attn.out_proj(a.view(rows, d))
      attn = layer.multihead_attn
      q = F.linear(layer.norm2(x), attn.in_proj_weight[:d], attn.in_proj_bias[:d])
      a = F.scaled_dot_product_attention(heads(q), memory_keys, memory_values)
      x = x + attn.out_proj(a.view(rows, d))
      x = x + layer.linear2(F.relu(layer.linear1(layer.norm3(x))))
    return F.linear(model.transformer.decoder.norm(x), model.embed.weight)  # -> [rows, vocab]

  try:
    compiled = torch.compile(fixed_shape_step)
    positions = [torch.tensor(i) for i in range(new_tokens)]
    step = lambda tokens, position, cache: compiled(tokens, positions[position], cache)
    eager, ours = torch_greedy_cached(decoder, new_tokens), torch_greedy_cached(decoder, new_tokens, step)
    if not torch.equal(eager(inputs), ours(inputs)):
      return None, "compiled step's tokens differ from eager's"
    return step, None
  except Exception as error:  # noqa: BLE001  (any failure of the compiler is reported, not fatal)
    message = str(error).strip().splitlines()
    return None, f"{type(error).__name__}: {message[0][:200] if message else ''}"


# --- report -------------------------------------------------------------------------------------

def decode_section(s, rng, repeats, torch_compile=True, reprojecting=True):
  """Greedy and beam decoding, JAX and torch, interleaved: {name: seconds}, the torch.compile status, and
  the check that the cached torch decoder's tokens equal the re-running decoder's. The re-running
  decoder (the no-cache row, ~10x the others' time) is timed once, in that check."""
  inputs = tokens(rng, s["vocab"], s["batch"], s["length"])
  model = make_translator(s)
  jax_decoders = decode_functions(model, s)
  if not reprojecting:
    del jax_decoders["greedy_reprojecting"]
  jax_inputs, torch_inputs = jnp.asarray(inputs), torch.from_numpy(inputs).long()
  decoders = {name: (lambda f=f: f(jax_inputs)) for name, f in jax_decoders.items()}
  placed = tensor_parallel(model, s["tensor_devices"])
  if placed is not None:  # the same model and searches, tensor-parallel: the same tokens
    placed_model, put, logits_sharding = placed
    placed_decoders, placed_inputs = decode_functions(placed_model, s, logits_sharding), put(inputs)
    for name in ("greedy", "beam"):
      assert np.array_equal(placed_decoders[name](placed_inputs), jax_decoders[name](jax_inputs)), name
      decoders[f"{name}_tensor_parallel"] = lambda f=placed_decoders[name]: f(placed_inputs)
  torch.manual_seed(0)
  torch_model = TorchTranslator(s).eval()
  cached = TorchCachedDecoder(torch_model, s["new_tokens"])
  rerun, greedy = torch_greedy_rerun(torch_model, s["new_tokens"]), torch_greedy_cached(cached, s["new_tokens"])
  # The baseline decodes what torch.nn.Transformer decodes, token for token (EOS never emitted).
  start = time.perf_counter()
  reference = rerun(torch_inputs)
  rerun_seconds = time.perf_counter() - start
  assert torch.equal(greedy(torch_inputs), reference), "cached torch decoder differs from the re-running decoder"
  decoders["torch_greedy_cached"] = lambda: greedy(torch_inputs)
  decoders["torch_beam_cached"] = lambda: torch_beam_cached(cached, s["new_tokens"], s["beam"], 0.6, s["vocab"])(
      torch_inputs)
  step, compile_failure = compiled_step(cached, torch_inputs, s["new_tokens"]) if torch_compile else (
      None, "not run (--no_torch_compile)")
  print(f"torch.compile of the decode step: {compile_failure or 'compiled, tokens equal eager'}", flush=True)
  if step is not None:
    compiled_greedy = torch_greedy_cached(cached, s["new_tokens"], step)
    decoders["torch_greedy_cached_compiled"] = lambda: compiled_greedy(torch_inputs)
  # Interleaved: the machine's speed drifts by several percent over the minutes this takes, so its matmul
  # rate and copy bandwidth (the limit's denominators) are timed in the same rounds, several runs a round.
  runs = 5
  probes = machine_rate_probes(runs)
  seconds = interleaved_median_seconds({**decoders, **probes}, repeats, warmup=1)
  rates = machine_rates({name: seconds.pop(name) for name in probes}, runs)
  return dict(seconds, torch_greedy_rerun=rerun_seconds), compile_failure, rates


SECTIONS = ("training", "decoding", "compile")
# The results keys each section writes (a partial run keeps the other sections of the file it rewrites).
SECTION_KEYS = {"training": ("training", "training_flops"),
                "decoding": ("decoding", "torch_compile", "decode_limit"),
                "compile": ("compile_s", "step_s_at_benchmark_depth")}


def add_arguments(parser):
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated sections to run, of {SECTIONS} (default: all)")
  parser.add_argument("--repeats", type=int, default=None, help="runs per median (default: the sizes' own)")
  parser.add_argument("--no_torch_compile", action="store_true", help="decoding: no torch.compile row")
  parser.add_argument("--no_reprojecting", action="store_true",
                      help="decoding: no row re-projecting the memory's keys / values every step")
  parser.add_argument("--render", nargs="+", default=None, metavar="JSON",
                      help="measure nothing: merge these results files (sections run separately) and write the tables")


def training_section(s, rng, results):
  # JAX runs one step per call, and launch.py's STEPS_PER_CALL steps per call (time per step = call
  # time / STEPS_PER_CALL): the same updates, but XLA:CPU allocates and page-faults the step's
  # temporaries once per call. Torch runs AdamW fused (its CPU fast path) and at its default.
  calls = interleaved_median_seconds({"jax": jax_training(s, rng), "jax_multi": jax_training(s, rng, STEPS_PER_CALL),
                                      "torch": torch_training(s, rng, fused=True),
                                      "torch_default_adamw": torch_training(s, rng, fused=False)}, s["repeats"],
                                     warmup=2)
  jax_step, torch_step, torch_default = calls["jax"], calls["torch"], calls["torch_default_adamw"]
  multi_step = calls["jax_multi"] / STEPS_PER_CALL
  step_tokens = s["batch"] * 2 * s["length"]
  matmul_rate = matmul_flops_per_second(s["repeats"])
  flops = training_flops(s)
  print(f"train step: jax {jax_step:.3f} s ({multi_step:.3f} s at {STEPS_PER_CALL} steps per call), "
        f"torch fused AdamW {torch_step:.3f} s, default AdamW {torch_default:.3f} s", flush=True)
  results["training"] = {
      "jax_step_s": jax_step, "torch_step_s": torch_step, "torch_default_adamw_step_s": torch_default,
      "torch_optimizer": "AdamW(fused=True)", "steps_per_call": STEPS_PER_CALL, "jax_multi_step_s": multi_step,
      "step_tokens": step_tokens, "ratio_vs_torch": torch_step / jax_step,
      "multi_ratio_vs_torch": torch_step / multi_step, "multi_ratio_vs_torch_default_adamw": torch_default / multi_step}
  results["training_flops"] = {"train_step_flops": flops, "matmul_2048_flops_per_s": matmul_rate,
                               "fraction_of_matmul": flops / jax_step / matmul_rate,
                               "multi_fraction_of_matmul": flops / multi_step / matmul_rate}


def decoding_section(s, rng, results):
  decode_seconds, compile_failure, (matmul_rate, bandwidth) = decode_section(
      s, rng, s["repeats"] // 2 + 1, s["torch_compile"], s["reprojecting"])
  print(f"decode seconds: {decode_seconds}", flush=True)
  work = greedy_work(s)
  limit = machine_limit_seconds(work, matmul_rate, bandwidth)
  print(f"matmul 2048^3: {matmul_rate / 1e9:.1f} GFLOP/s; copy bandwidth {bandwidth / 1e9:.1f} GB/s; greedy limit "
        f"{limit:.3f} s; ours {decode_seconds['greedy']:.3f} s = {limit / decode_seconds['greedy']:.2f} of it", flush=True)
  new_tokens = s["batch"] * s["new_tokens"]
  results["decoding"] = {name: {"seconds": t, "new_tokens_per_s": new_tokens / t} for name, t in decode_seconds.items()}
  results["torch_compile"] = compile_failure or "ok"
  results["decode_limit"] = {
      "encode_flops": work[0], "step_flops": sum(f for f, _ in work[1]), "step_bytes": sum(b for _, b in work[1]),
      "matmul_2048_flops_per_s": matmul_rate, "copy_bytes_per_s": bandwidth, "greedy_limit_s": limit,
      "fraction_of_limit": limit / decode_seconds["greedy"],
      **({"tensor_parallel_fraction_of_limit": limit / decode_seconds["greedy_tensor_parallel"],
          "tensor_devices": s["tensor_devices"]} if "greedy_tensor_parallel" in decode_seconds else {})}


def compile_section(s, rng, results):
  compile_seconds, scan_step_seconds = compile_and_step_times(s, rng)
  results["compile_s"] = {f"layers={n},scan={scan}": c for (n, scan), c in compile_seconds.items()}
  results["step_s_at_benchmark_depth"] = {(k if isinstance(k, str) else f"scan={k}"): t
                                          for k, t in scan_step_seconds.items()}


def render(results) -> str:
  """The markdown tables of whichever sections `results` holds."""
  s, m = results["sizes"], results["machine"]

  def row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"

  runs = "; ".join(f"{r['sections']}: commit {r['commit']}, `{r['command']}`, {r['started']} to {r['ended']}, "
                   f"1-minute load average before it started {r['load_average_before']:.1f}"
                   + (f", {HostContention.describe(r['contention'])}" if "contention" in r else "")
                   + (f", on {r['cpu']}" if "cpu" in r else "") for r in m["runs"])
  lines = [
      "# Translator benchmark", "",
      f"{m['cores']} CPU cores ({m['platform']}), jax {m['jax']}, torch {m['torch']} ({m['torch_threads']} threads), "
      f"float32 on both sides. Sizes: d_model {s['d_model']}, {s['num_heads']} heads, {s['num_layers']}+{s['num_layers']} "
      f"layers, MLP {s['mlp_dim']}, vocab {s['vocab']}, batch {s['batch']}, source/target length {s['length']}. "
      f"Medians of {s['repeats']} runs after warm-up (decoding: {s['repeats'] // 2 + 1}), every row of a table "
      "interleaved run by run in one process, so a change in load hits every row alike; a load average well "
      "above the 2 cores means other jobs shared them: absolute times are then pessimistic, ratios hold "
      f"better. Runs: {runs}.", ""]
  if "training" in results:
    t, f = results["training"], results["training_flops"]
    tokens = t["step_tokens"]
    lines += [
        "## Training (forward + backward + AdamW)", "",
        row("", "step s", "tokens/s (source + target)", "vs torch, fused AdamW"), row("---", "---", "---", "---"),
        row(f"xattn_jax Translator, {t['steps_per_call']} steps per jitted call (launch.py's default)",
            f"{t['jax_multi_step_s']:.3f}", f"{tokens / t['jax_multi_step_s']:.0f}",
            f"**{t['multi_ratio_vs_torch']:.2f}x** (target >= 1.1x)"),
        row("xattn_jax Translator, one step per call (steps_per_call=1)", f"{t['jax_step_s']:.3f}",
            f"{tokens / t['jax_step_s']:.0f}", f"**{t['ratio_vs_torch']:.2f}x** (target >= 0.95x)"),
        row("torch.nn.Transformer (eager), AdamW(fused=True)", f"{t['torch_step_s']:.3f}",
            f"{tokens / t['torch_step_s']:.0f}", "1.00x"),
        row("torch.nn.Transformer (eager), AdamW default (per-tensor loop)", f"{t['torch_default_adamw_step_s']:.3f}",
            f"{tokens / t['torch_default_adamw_step_s']:.0f}",
            f"{t['torch_step_s'] / t['torch_default_adamw_step_s']:.2f}x"),
        "",
        f"Each step is one batch's forward, backward and AdamW update; {t['steps_per_call']} steps per call run the "
        "same updates as one per call; what differs is the per-call cost (dispatch, and XLA:CPU allocating and "
        "page-faulting the step's temporaries), paid once per call instead of once per step. Against torch's "
        f"default AdamW, {t['steps_per_call']} steps per call run at {t['multi_ratio_vs_torch_default_adamw']:.2f}x.",
        "",
        f"Achieved training FLOP/s at {t['steps_per_call']} steps per call: "
        f"{f['train_step_flops'] / t['jax_multi_step_s'] / 1e9:.1f} GFLOP/s ({f['train_step_flops'] / 1e9:.1f} GFLOP "
        f"per step, matmul FLOPs x 3); float32 2048^3 matmul in this process: "
        f"{f['matmul_2048_flops_per_s'] / 1e9:.1f} GFLOP/s; fraction **{f['multi_fraction_of_matmul']:.2f}**; one "
        f"step per call: {f['fraction_of_matmul']:.2f}.", ""]
  if "decoding" in results:
    d, lim = results["decoding"], results["decode_limit"]
    seconds = {name: v["seconds"] for name, v in d.items()}
    greedy_base, beam_base = seconds["torch_greedy_cached"], seconds["torch_beam_cached"]
    lines += [
        f"## Decoding (batch {s['batch']}, source length {s['length']}, {s['new_tokens']} new tokens, EOS disabled)", "",
        "The torch baseline is a cached decoder written from torch.nn.Transformer's own weights (self-attention "
        "keys / values appended per token into preallocated caches, the memory's keys / values projected once, "
        "logits for the new position only, F.scaled_dot_product_attention); the script asserts its tokens equal "
        "the re-running decoder's, token for token. Its beam search is decoding.beam_search's algorithm "
        "(the memory's keys / values projected once per source and repeated for its beams, reordering only the "
        "filled part of the self-attention caches). Ours keeps the memory's keys / values once per source, read "
        "by all its beams, and reorders the self-attention caches by index (`KVCache` beam layout). The "
        "re-running decoder is the no-cache row: it does other work (~40x the FLOPs).", "",
        row("", "seconds", "new tokens/s", "vs torch cached (same search)"), row("---", "---", "---", "---")]
    for name, label, base in (
        ("greedy", "xattn_jax greedy, cached, jitted (cross-attention K/V projected once)", greedy_base),
        ("greedy_reprojecting", "xattn_jax greedy, cached, memory K/V re-projected every step", greedy_base),
        ("greedy_kernels_in_out", "xattn_jax greedy, its kernels as trained ([in, out]; `transpose_kernels=False`)",
         greedy_base),
        ("greedy_tensor_parallel", f"xattn_jax greedy, tensor-parallel over {lim.get('tensor_devices')} CPU devices "
         "(heads / MLP / vocabulary split, one core each)", greedy_base),
        ("torch_greedy_cached", "torch greedy, cached, eager", greedy_base),
        ("torch_greedy_cached_compiled", "torch greedy, cached, torch.compile of the step (fixed shapes)",
         greedy_base),
        ("torch_greedy_rerun", "torch.nn.Transformer greedy, no cache (decoder re-run on the prefix; one run)",
         greedy_base),
        ("beam", f"xattn_jax beam search, beam {s['beam']} (tokens of the best beam)", beam_base),
        ("beam_kernels_in_out", f"xattn_jax beam search, beam {s['beam']}, its kernels as trained ([in, out])",
         beam_base),
        ("beam_tensor_parallel", f"xattn_jax beam search, beam {s['beam']}, tensor-parallel over "
         f"{lim.get('tensor_devices')} CPU devices", beam_base),
        ("torch_beam_cached", f"torch beam search, beam {s['beam']}, cached, eager", beam_base)):
      if name in ("greedy_reprojecting", "greedy_kernels_in_out", "beam_kernels_in_out", "greedy_tensor_parallel",
                  "beam_tensor_parallel") and name not in d:
        continue  # (not run, or a results file from before the row)
      if name in d:
        lines.append(row(label, f"{seconds[name]:.3f}", f"{d[name]['new_tokens_per_s']:.0f}",
                         f"{base / seconds[name]:.2f}x"))
      else:
        lines.append(row(label, "failed", "", results["torch_compile"]))
    limit = lim["greedy_limit_s"]
    lines += [
        "", f"Greedy vs cached torch: **{greedy_base / seconds['greedy']:.2f}x** (target >= 1.5x); beam {s['beam']} "
        f"vs cached torch beam: **{beam_base / seconds['beam']:.2f}x** (target >= 1.5x); greedy vs the no-cache "
        f"torch decoder: {seconds['torch_greedy_rerun'] / seconds['greedy']:.1f}x (not the same work)."
        + (f" Projecting the memory once vs every step: {seconds['greedy_reprojecting'] / seconds['greedy']:.2f}x "
           "faster." if "greedy_reprojecting" in seconds else ""), "",
        f"Machine limit for greedy decoding (`greedy_work`): encoding {lim['encode_flops'] / 1e9:.1f} GFLOP, then "
        f"{s['new_tokens']} steps of {lim['step_flops'] / 1e9:.1f} GFLOP and {lim['step_bytes'] / 1e9:.2f} GB in all "
        "(every weight read once a step, the caches and the logits), against the 2048^3 matmul rate "
        f"{lim['matmul_2048_flops_per_s'] / 1e9:.1f} GFLOP/s and copy bandwidth {lim['copy_bytes_per_s'] / 1e9:.1f} "
        f"GB/s (both timed in the decoders' interleaved rounds, medians), each step bounded by the larger of its two "
        f"times: **{limit:.3f} s**. Our greedy decoder reaches "
        f"**{lim['fraction_of_limit']:.2f}** of that limit (target >= 0.5)"
        + (f", tensor-parallel **{lim['tensor_parallel_fraction_of_limit']:.2f}**"
           if "tensor_parallel_fraction_of_limit" in lim else "") + f"; torch cached eager {limit / greedy_base:.2f}.",
        ""]
    if "greedy_tensor_parallel" in seconds:
      lines += [
          f"Tensor-parallel over {lim['tensor_devices']} CPU devices (the same model placed by "
          "`sharding.place_model` on a (data=1, tensor) mesh, the launcher's default rules; the same tokens, "
          f"asserted): greedy **{greedy_base / seconds['greedy_tensor_parallel']:.2f}x** cached torch, beam "
          f"**{beam_base / seconds['beam_tensor_parallel']:.2f}x**. torch runs its {m['torch_threads']} threads "
          "over the same cores.", ""]
  if "compile_s" in results:
    c, st = results["compile_s"], results["step_s_at_benchmark_depth"]
    layers = s["compile_layers"]
    growth = lambda scan: c[f"layers={layers[-1]},scan={scan}"] / c[f"layers={layers[0]},scan={scan}"]
    lines += ["## Train-step compile time (layers per stack)", "",
              row("layers", "compile s, unrolled", "compile s, scan"), row("---", "---", "---")]
    for n in layers:
      lines.append(row(n, f"{c[f'layers={n},scan=False']:.2f}", f"{c[f'layers={n},scan=True']:.2f}"))
    lines += ["", f"Compile time at {layers[-1]} layers / {layers[0]} layers: scan **{growth(True):.2f}x** "
              f"(target <= 1.5x), unrolled {growth(False):.2f}x.", "",
              f"Train step at {s['num_layers']}+{s['num_layers']} layers, all variants interleaved (target: "
              "scanned <= 1.05x unrolled):", "",
              row("variant", "step s", "vs unrolled, no remat"), row("---", "---", "---")]
    for key, label in (("scan=False", "unrolled"), ("unrolled_remat_dots_no_batch", "unrolled, remat=dots_no_batch"),
                       ("scan=True", "scan"), ("scan_remat_dots", "scan, remat=dots"),
                       ("scan_remat_dots_no_batch", "scan, remat=dots_no_batch")):
      lines.append(row(label, f"{st[key]:.3f}", f"**{st[key] / st['scan=False']:.3f}**"))
    lines.append("")
  return "\n".join(lines)


def keep_other_sections(path: pathlib.Path, results: dict, sections) -> dict:
  """results of the sections just run, plus the other sections of the results file at path (if any): a
  partial run rewrites its own tables only. Each run keeps its own record (commit, command, dates)."""
  if set(sections) == set(SECTIONS) or not path.is_file():
    return results
  previous = json.loads(path.read_text())
  kept = [name for name in SECTIONS if name not in sections and SECTION_KEYS[name][0] in previous]
  if not kept:
    return results
  merged = dict(results)
  for name in kept:
    merged.update({key: previous[key] for key in SECTION_KEYS[name] if key in previous})
  earlier = [run for run in previous.get("machine", {}).get("runs", [])
             if set(run["sections"].split(",")) & set(kept)]
  merged["machine"] = dict(results["machine"], runs=earlier + results["machine"]["runs"])
  return merged


def main():
  args, s, cores = parse_jax_vs_torch_args(__doc__, FULL, QUICK, add_arguments, tensor_devices=True)
  out = pathlib.Path(args.out)
  if args.render:
    results = {}
    for path in args.render:
      part = json.loads(pathlib.Path(path).read_text())
      runs = results.get("machine", {}).get("runs", []) + part["machine"]["runs"]
      results.update(part)
      results["machine"]["runs"] = runs
  else:
    sections = tuple(args.sections.split(","))
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown or (args.repeats is not None and args.repeats < 1):
      raise SystemExit(f"--sections must name some of {SECTIONS}, got {args.sections!r}" if unknown else
                       f"--repeats must be >= 1, got {args.repeats}")
    s = dict(s, repeats=args.repeats or s["repeats"], torch_compile=not args.no_torch_compile,
             reprojecting=not args.no_reprojecting, tensor_devices=args.tensor_devices)
    # Taken before any work: from here on the benchmark itself keeps the cores busy (load ~2).
    run = {"sections": ",".join(sections), "load_average_before": os.getloadavg()[0],
           "started": time.strftime("%Y-%m-%d %H:%M"), **run_record()}
    contention = HostContention()
    rng = np.random.default_rng(0)
    print(f"sizes: {s}; cores: {cores}; torch threads: {torch.get_num_threads()}", flush=True)
    results = {"machine": {"cores": cores, "platform": platform.platform(), "jax": jax.__version__,
                           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                           "glibc_tunables": os.environ.get("GLIBC_TUNABLES")},
               "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()}}
    for name, section in (("training", training_section), ("decoding", decoding_section),
                          ("compile", compile_section)):
      if name in sections:
        section(s, rng, results)
    results["machine"]["runs"] = [dict(run, ended=time.strftime("%Y-%m-%d %H:%M"), contention=contention.summary())]
    results = keep_other_sections(out / "translator_benchmark.json", results, sections)
  markdown = render(results)
  print(markdown)
  write_results(out, "translator_benchmark", results, markdown)


if __name__ == "__main__":
  main()
