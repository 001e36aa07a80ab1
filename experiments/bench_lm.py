"""Decoder-only LM speed against torch: training tokens/s, prefill and cached-decode tokens/s.

One process, both libraries, float32 on both sides, interleaved runs, medians after warm-up, every JAX
call ended by block_until_ready. The same decoder on both sides, with the JAX model's weights copied
into the torch one (the script checks their logits agree before it times anything):

  pre-LN blocks (LayerNorm, eps 1e-6), causal self-attention with biases on q / k / v / out and 1D
  RoPE (split halves, base 10000) on q and k, a GELU (tanh form) MLP, a final LayerNorm, token
  embeddings scaled by sqrt(d_model), and the output tied to the embedding. Rows are plain causal
  sequences (no packing), so both sides run causal attention without a segment mask.

  (a) training: forward, mean cross-entropy, backward and AdamW (lr 1e-4, betas (0.9, 0.98), eps 1e-9,
      weight decay 0.01 on every parameter, no clipping, constant lr) on both sides. JAX is
      xattn_jax.models.lm.LanguageModel under optax.adamw, jitted over nnx.split state (donated), at
      launch.py's default steps per call (configs/lm_text.py, trainer.multi_step) and at one step per
      call; torch is eager with AdamW(fused=True), and its default AdamW (the per-tensor loop on CPU),
      labeled.
  (b) prefill: a prompt into an empty cache, logits of the last position only (what decoding needs).
  (c) decode: greedy, 128 steps from the prefilled cache, each feeding one token per row.
      JAX: LanguageModel.prefill, and LanguageModel.loop_step inside decoding.greedy_search (a
      jitted lax.while_loop), its kernels stored [out, in], and beside it the same decode with the
      kernels as trained ([in, out]), and the same prefill and decode tensor-parallel over --tensor_devices
      CPU devices (default: one per core; heads, MLP and vocabulary split, `sharding.place_model`; the
      same tokens). torch: a hand-written cache from the torch model's own modules (keys /
      values written per token into preallocated [batch, heads, capacity, head_dim] buffers,
      F.scaled_dot_product_attention over the filled rows, logits for the last position), eager, and
      under torch.compile (dynamic shapes) where that works on this machine (a failure is recorded).
      Beside them, this machine's limit for the decode's work (decode_work: FLOPs at the 2048^3 matmul
      rate, bytes at the copy bandwidth, both timed in the same rounds) and the share of it each reaches.

Results: experiments/results/lm_benchmark.{md,json}.

    python experiments/bench_lm.py            # the full sizes (about 10 minutes on 2 idle cores)
    python experiments/bench_lm.py --quick    # a tiny smoke run, results in a temporary directory
"""
from __future__ import annotations

import math
import os
import pathlib
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import torch.nn.functional as F
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
import bench_common  # noqa: E402
from bench_common import blocked_median_seconds, parse_jax_vs_torch_args, tensor_parallel  # noqa: E402
from configs import lm_text  # noqa: E402
from xattn_jax import decoding  # noqa: E402
from xattn_jax.models import lm as lm_lib  # noqa: E402
from xattn_jax.training import optim  # noqa: E402
from xattn_jax.training import trainer as trainer_lib  # noqa: E402

FULL = dict(d_model=512, num_heads=8, num_layers=8, mlp_dim=2048, vocab=8000, batch=16, length=256,
            prompt=128, new_tokens=128, train_rounds=2, decode_rounds=3)
QUICK = dict(d_model=64, num_heads=4, num_layers=2, mlp_dim=128, vocab=300, batch=2, length=16,
             prompt=8, new_tokens=8, train_rounds=2, decode_rounds=2)
# launch.py's default for the LM config: optimizer steps per jitted call (trainer.multi_step).
STEPS_PER_CALL = lm_text.get_config().steps_per_call
ADAMW = dict(learning_rate=1e-4, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.01)


def _figure(value: float, decimals: int) -> str:
  """value to `decimals` places, or to two significant digits where those places would read 0 (a --quick run)."""
  return f"{value:.{decimals}f}" if round(value, decimals) else f"{value:.2g}"


def random_tokens(rng, vocab, batch, length):
  """Ids >= 3 (no padding, BOS or EOS) int32 [batch, length]."""
  return rng.integers(3, vocab, (batch, length)).astype(np.int32)


# --- JAX side -----------------------------------------------------------------------------------

def make_jax_model(s, seed=0) -> lm_lib.LanguageModel:
  return lm_lib.LanguageModel(
      s["vocab"], d_model=s["d_model"], num_heads=s["num_heads"], num_layers=s["num_layers"], mlp_dim=s["mlp_dim"],
      position_encoding="rope", max_length=max(s["length"], s["prompt"] + s["new_tokens"]),
      norm_type="layernorm", mlp_type="mlp", activation="gelu", tie_output=True, use_bias=True,
      rngs=nnx.Rngs(params=seed, dropout=seed))


def jax_train_call(s, rng, steps_per_call):
  """A function that runs one jitted call of `steps_per_call` training steps (trainer.multi_step, the
  launcher's program; 1 = the plain step, no loop) and blocks until it is done."""
  model = make_jax_model(s)
  optimizer = nnx.Optimizer(model, optax.adamw(**ADAMW), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, batch, step, rng_key):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      logits = model(batch["inputs"])  # -> [batch, length, vocab]
      loss_sum, weight_sum = optim.cross_entropy(logits, batch["targets"])
      return loss_sum / weight_sum

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss}

  step = jax.jit(trainer_lib.multi_step(train_step), donate_argnums=0)
  batches = {name: jnp.asarray(np.stack([random_tokens(rng, s["vocab"], s["batch"], s["length"])
                                         for _ in range(steps_per_call)])) for name in ("inputs", "targets")}
  return bench_common.multi_step_call(step, state, batches, steps_per_call)


def jax_decoders(model, s, transpose_kernels: bool = True):
  """(prefill(prompt [b, t]) -> (last logits [b, vocab], cache), decode(cache, first [b]) -> tokens
  [b, new_tokens]), both jitted over the model's split state; each result is blocked on. The decode's
  kernels stored [out, in] (loop_step's default) or, with transpose_kernels=False, as trained."""
  graphdef, state = nnx.split(model)
  capacity = s["prompt"] + s["new_tokens"]

  @jax.jit
  def prefill(state, prompt):
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(prompt.shape[0], capacity)
    logits, cache = model.prefill(prompt, cache, valid=jnp.ones(prompt.shape, bool))  # -> [b, t, vocab]
    return logits[:, -1], cache

  @jax.jit
  def decode(state, cache, first):  # eos_id = vocab: an id the model cannot emit, so every step runs
    model = nnx.merge(graphdef, state)
    return decoding.greedy_search(model.loop_step(transpose_kernels=transpose_kernels), cache,
                                  batch_size=first.shape[0], max_length=s["new_tokens"],
                                  bos_id=1, eos_id=s["vocab"], pad_id=0, first_tokens=first).tokens

  return (lambda prompt: jax.block_until_ready(prefill(state, prompt)),
          lambda cache, first: jax.block_until_ready(decode(state, cache, first)))


# --- torch side ---------------------------------------------------------------------------------

def decode_work(s):
  """FLOPs and bytes the greedy decode after the prefill must move at the least: (0, [(FLOPs, bytes) per
  step]). Each step runs batch rows through every layer (the q / k / v / out projections and the MLP, and
  attention over the cached keys up to and including this token's) and the tied vocabulary projection; its
  bytes are every weight read once, the filled cache read and this token's keys / values written, and the
  logits written and read once (float32). Norms, biases and RoPE are left out (a few percent)."""
  d, f, n, v, b = s["d_model"], s["mlp_dim"], s["num_layers"], s["vocab"], s["batch"]
  layer_weights, steps = 4 * d * d + 2 * d * f, []
  for t in range(s["new_tokens"]):
    keys = s["prompt"] + t + 1
    flops = 2 * b * (n * (layer_weights + 2 * keys * d) + d * v)
    floats = n * layer_weights + v * d + b * n * (2 * keys * d + 2 * d) + 2 * b * v
    steps.append((flops, 4 * floats))
  return 0, steps


def rope_tables(head_dim, positions):
  """cos, sin [len(positions), head_dim / 2] of RoPE base 10000, as ops.positions.rope_angles."""
  inverse = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
  angles = positions.to(torch.float32)[:, None] * inverse
  return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
  """x [b, heads, t, head_dim] rotated pair (i, i + head_dim/2) by the angles of its row (cos / sin [t, h/2])."""
  first, second = x.chunk(2, dim=-1)
  return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class TorchBlock(torch.nn.Module):
  def __init__(self, s):
    super().__init__()
    d, f = s["d_model"], s["mlp_dim"]
    self.num_heads = s["num_heads"]
    self.attention_norm = torch.nn.LayerNorm(d, eps=1e-6)
    self.query, self.key, self.value, self.out = (torch.nn.Linear(d, d) for _ in range(4))
    self.mlp_norm = torch.nn.LayerNorm(d, eps=1e-6)
    self.wi, self.wo = torch.nn.Linear(d, f), torch.nn.Linear(f, d)

  def _heads(self, x):  # [b, t, d] -> [b, heads, t, head_dim]
    return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

  def _mlp_residual(self, x):
    return x + self.wo(F.gelu(self.wi(self.mlp_norm(x)), approximate="tanh"))

  def _attention_output(self, heads):  # [b, heads, t, head_dim] -> [b, t, d]
    return self.out(heads.transpose(1, 2).flatten(2))

  def forward(self, x, cos, sin):
    """x [b, t, d] -> [b, t, d], causal."""
    h = self.attention_norm(x)
    q, k = apply_rope(self._heads(self.query(h)), cos, sin), apply_rope(self._heads(self.key(h)), cos, sin)
    heads = F.scaled_dot_product_attention(q, k, self._heads(self.value(h)), is_causal=True)
    return self._mlp_residual(x + self._attention_output(heads))

  def extend(self, x, cos, sin, keys, values, start: int):
    """Writes x [b, t, d]'s keys / values into the buffers keys / values [b, heads, capacity, head_dim]
    at rows start.. and attends causally to rows 0 .. start + t - 1 -> [b, t, d]."""
    h = self.attention_norm(x)
    end = start + x.shape[1]
    keys[:, :, start:end] = apply_rope(self._heads(self.key(h)), cos, sin)
    values[:, :, start:end] = self._heads(self.value(h))
    q = apply_rope(self._heads(self.query(h)), cos, sin)
    # One query (a decode step) sees every filled row; a prompt into an empty cache is plain causal.
    if x.shape[1] > 1 and start != 0:
      raise ValueError(f"TorchBlock.extend: a prompt of {x.shape[1]} tokens goes into an empty cache, got start={start}")
    heads = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], is_causal=x.shape[1] > 1)
    return self._mlp_residual(x + self._attention_output(heads))


class TorchLM(torch.nn.Module):
  """The JAX LanguageModel of make_jax_model, in torch; `copy_from` loads its weights."""

  def __init__(self, s):
    super().__init__()
    self.d_model, self.num_heads, self.head_dim = s["d_model"], s["num_heads"], s["d_model"] // s["num_heads"]
    self.embed = torch.nn.Embedding(s["vocab"], s["d_model"])
    self.blocks = torch.nn.ModuleList(TorchBlock(s) for _ in range(s["num_layers"]))
    self.final_norm = torch.nn.LayerNorm(s["d_model"], eps=1e-6)

  @torch.no_grad()
  def copy_from(self, model: lm_lib.LanguageModel):
    def put(linear, dense):
      linear.weight.copy_(torch.from_numpy(np.asarray(dense.kernel[...]).T.copy()))
      linear.bias.copy_(torch.from_numpy(np.array(dense.bias[...])))

    def put_norm(norm, nnx_norm):
      norm.weight.copy_(torch.from_numpy(np.array(nnx_norm.scale[...])))
      norm.bias.copy_(torch.from_numpy(np.array(nnx_norm.bias[...])))

    self.embed.weight.copy_(torch.from_numpy(np.array(model.embed.embedding[...])))
    for block, layer in zip(self.blocks, model.layers()):
      for name in ("query", "key", "value", "out"):
        put(getattr(block, name), getattr(layer.attention, name))
      put(block.wi, layer.mlp.wi)
      put(block.wo, layer.mlp.wo)
      put_norm(block.attention_norm, layer.attention_norm)
      put_norm(block.mlp_norm, layer.mlp_norm)
    put_norm(self.final_norm, model.final_norm)
    return self

  def _embed(self, tokens):
    return self.embed(tokens) * math.sqrt(self.d_model)

  def _logits(self, x):
    return self.final_norm(x) @ self.embed.weight.T

  def forward(self, tokens):
    """tokens [b, t] -> logits [b, t, vocab] (causal, positions 0..t-1)."""
    cos, sin = rope_tables(self.head_dim, torch.arange(tokens.shape[1]))
    x = self._embed(tokens)
    for block in self.blocks:
      x = block(x, cos, sin)
    return self._logits(x)

  def new_cache(self, batch, capacity):
    """Per layer, (keys, values) buffers [b, heads, capacity, head_dim]."""
    shape = (batch, self.num_heads, capacity, self.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in self.blocks]

  def extend(self, tokens, cache, start: int, block_extend=TorchBlock.extend):
    """tokens [b, t] at positions start.. into the cache -> logits of the last position [b, vocab].

    block_extend(block, x, cos, sin, keys, values, start) runs one block (e.g. a torch.compile'd
    TorchBlock.extend: one graph serves every layer, since parameters are graph inputs)."""
    cos, sin = rope_tables(self.head_dim, torch.arange(start, start + tokens.shape[1]))
    x = self._embed(tokens)
    for block, (keys, values) in zip(self.blocks, cache):
      x = block_extend(block, x, cos, sin, keys, values, start)
    return self._logits(x[:, -1])


def torch_greedy(step, cache, first, start: int, new_tokens: int):
  """new_tokens greedy steps from a cache filled up to `start`, feeding first [b] -> tokens [b, new_tokens]."""
  token, out = first, []
  for i in range(new_tokens):
    token = step(token[:, None], cache, start + i).argmax(-1)
    out.append(token)
  return torch.stack(out, dim=1)


def on_threads(threads: int, fn):
  """fn run with torch limited to `threads` intra-op threads (restored afterwards)."""
  def run(*args):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
      return fn(*args)
    finally:
      torch.set_num_threads(before)
  return run


def torch_train_call(s, rng, jax_model, fused: bool):
  """One eager training step of the torch model with AdamW (fused or torch's default)."""
  model = TorchLM(s).copy_from(jax_model)
  optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW["learning_rate"], betas=(ADAMW["b1"], ADAMW["b2"]),
                                eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], fused=fused or None)
  inputs, targets = (torch.from_numpy(random_tokens(rng, s["vocab"], s["batch"], s["length"])).long() for _ in range(2))

  def run():
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()

  return run


def torch_decoders(model: TorchLM, s, compiled: bool):
  """(prefill(prompt) -> (last logits, cache), decode(cache, first) -> tokens), eager or with each block's
  cached step torch.compile'd (dynamic shapes: one graph for the prompt, one for every decode step)."""
  block_extend = torch.compile(TorchBlock.extend, dynamic=True) if compiled else TorchBlock.extend
  capacity = s["prompt"] + s["new_tokens"]

  def extend(tokens, cache, start):
    return model.extend(tokens, cache, start, block_extend)

  def prefill(prompt):
    with torch.inference_mode():
      cache = model.new_cache(prompt.shape[0], capacity)
      return extend(prompt, cache, 0), cache

  def decode(cache, first):
    with torch.inference_mode():
      return torch_greedy(extend, cache, first, s["prompt"], s["new_tokens"])

  return prefill, decode


# --- provenance and checks ----------------------------------------------------------------------

def provenance(load_before: float) -> dict:
  """bench_common.provenance with the commit as `commit_label` prints it (the whole hash), the date as `date_utc`
  and the load measured before the models were built."""
  record = bench_common.provenance()
  return {**record, "commit": bench_common.commit_label(record, None),
          "date_utc": record["date"].removesuffix(" UTC"), "load_average_before": load_before}


def check_agreement(jax_model, torch_model, s, rng) -> dict:
  """Largest |logit difference| of the full forward and of prefill + cached steps between the two models,
  and the torch cached decode against its own uncached forward (float32)."""
  tokens = random_tokens(rng, s["vocab"], 2, min(s["prompt"], 16) + 4)
  prompt_length = tokens.shape[1] - 4
  jax_logits = np.asarray(jax_model(jnp.asarray(tokens)))
  with torch.inference_mode():
    full = torch_model(torch.from_numpy(tokens).long())
    cache = torch_model.new_cache(2, tokens.shape[1])
    steps = [torch_model.extend(torch.from_numpy(tokens[:, :prompt_length]).long(), cache, 0)]
    for i in range(prompt_length, tokens.shape[1]):
      steps.append(torch_model.extend(torch.from_numpy(tokens[:, i:i + 1]).long(), cache, i))
  cached = torch.stack(steps, dim=1).numpy()  # logits at positions prompt_length - 1 .. end
  return {"forward_jax_vs_torch": float(np.abs(jax_logits - full.numpy()).max()),
          "torch_cached_vs_forward": float(np.abs(cached - full.numpy()[:, prompt_length - 1:]).max()),
          "logit_scale": float(np.abs(jax_logits).max())}


# --- report -------------------------------------------------------------------------------------

def row(*cells):
  return "| " + " | ".join(str(c) for c in cells) + " |"


def main():
  args, s, cores = parse_jax_vs_torch_args(__doc__, FULL, QUICK, tensor_devices=True)
  load_before = os.getloadavg()[0]
  start_time = time.time()
  contention = bench_common.HostContention()
  meta = provenance(load_before)
  meta.update(cores=cores, platform=platform.platform(), jax=jax.__version__, torch=torch.__version__,
              torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads(),
              jax_devices=[str(d) for d in jax.devices()], xla_flags=os.environ.get("XLA_FLAGS", ""),
              jax_num_cpu_devices=jax.config.jax_num_cpu_devices, steps_per_call=STEPS_PER_CALL,
              tensor_devices=args.tensor_devices)
  print(f"{meta}\nsizes: {s}", flush=True)
  rng = np.random.default_rng(0)
  jax_model = make_jax_model(s)
  torch_model = TorchLM(s).copy_from(jax_model).eval()
  agreement = check_agreement(jax_model, torch_model, s, rng)
  print(f"agreement: {agreement}", flush=True)
  if not agreement["forward_jax_vs_torch"] <= 1e-3 * max(1.0, agreement["logit_scale"]):
    raise SystemExit(f"bench_lm: the torch model does not compute the JAX model's logits: {agreement}")

  # (a) training: each block runs one call per function (JAX's multi-step call is STEPS_PER_CALL steps).
  train = {"jax_multi": jax_train_call(s, rng, STEPS_PER_CALL), "jax_single": jax_train_call(s, rng, 1),
           "torch_fused": torch_train_call(s, rng, jax_model, fused=True),
           "torch_fused_1thread": on_threads(1, torch_train_call(s, rng, jax_model, fused=True)),
           "torch_default": torch_train_call(s, rng, jax_model, fused=False)}
  train_calls = blocked_median_seconds(train, blocks=s["train_rounds"], per_block=1, warmup=1, drop_first=False)
  step_seconds = {name: t / (STEPS_PER_CALL if name == "jax_multi" else 1) for name, t in train_calls.items()}
  print(f"train step seconds: {step_seconds}", flush=True)

  # (b) + (c)
  prompt = random_tokens(rng, s["vocab"], s["batch"], s["prompt"])
  jax_prefill, jax_decode = jax_decoders(jax_model, s)
  jax_prompt = jnp.asarray(prompt)
  jax_last, jax_cache = jax_prefill(jax_prompt)
  jax_first = jnp.argmax(jax_last, axis=-1).astype(jnp.int32)
  torch_prompt = torch.from_numpy(prompt).long()
  prefills = {"jax": lambda: jax_prefill(jax_prompt)}
  _, jax_decode_in_out = jax_decoders(jax_model, s, transpose_kernels=False)
  decodes = {"jax": lambda: jax_decode(jax_cache, jax_first),
             "jax_kernels_in_out": lambda: jax_decode_in_out(jax_cache, jax_first)}
  tokens_out = {"jax": np.asarray(jax_decode(jax_cache, jax_first)),
                "jax_kernels_in_out": np.asarray(jax_decode_in_out(jax_cache, jax_first))}
  placed = tensor_parallel(jax_model, args.tensor_devices)
  if placed is not None:  # the same model, prefill and decode over the devices, heads / MLP / vocabulary split
    placed_model, put, _ = placed  # greedy: the argmax reduces where the vocabulary lies
    tp_prefill, tp_decode = jax_decoders(placed_model, s)
    tp_prompt = put(prompt)
    tp_last, tp_cache = tp_prefill(tp_prompt)
    tp_first = jnp.argmax(tp_last, axis=-1).astype(jnp.int32)
    prefills["jax_tensor_parallel"] = lambda: tp_prefill(tp_prompt)
    decodes["jax_tensor_parallel"] = lambda: tp_decode(tp_cache, tp_first)
    tokens_out["jax_tensor_parallel"] = np.asarray(tp_decode(tp_cache, tp_first))
  compile_note = ""
  for name, compiled in (("torch_eager", False), ("torch_compile", True)):
    prefill, decode = torch_decoders(torch_model, s, compiled)
    try:
      begin = time.perf_counter()
      last, cache = prefill(torch_prompt)
      first = last.argmax(-1)
      tokens_out[name] = decode(cache, first).numpy()
      if compiled:
        compile_note = f"first prefill + decode (compiling) {time.perf_counter() - begin:.1f} s"
    except Exception as error:  # torch.compile on CPU needs a working C++ toolchain; record why it failed
      compile_note = f"torch.compile failed: {type(error).__name__}: {' '.join(str(error).split())[:300]}"
      traceback.print_exc()
      continue
    prefills[name] = lambda prefill=prefill: prefill(torch_prompt)
    decodes[name] = lambda decode=decode, cache=cache, first=first: decode(cache, first)
    if not compiled:  # on a loaded machine one thread can beat two (no OpenMP barrier waiting on a core)
      prefills[f"{name}_1thread"] = on_threads(1, prefills[name])
      decodes[f"{name}_1thread"] = on_threads(1, decodes[name])
  print(compile_note, flush=True)
  timed = {**{f"prefill_{k}": f for k, f in prefills.items()}, **{f"decode_{k}": f for k, f in decodes.items()}}
  # The machine's matmul rate and copy bandwidth (the decode limit's denominators) timed in the same rounds.
  probe_runs = 5
  probes = bench_common.machine_rate_probes(probe_runs)
  infer_seconds = blocked_median_seconds({**timed, **probes}, blocks=s["decode_rounds"], per_block=1, warmup=1,
                                         drop_first=False)
  matmul_rate, bandwidth = bench_common.machine_rates({name: infer_seconds.pop(name) for name in probes}, probe_runs)
  work = decode_work(s)
  limit = bench_common.machine_limit_seconds(work, matmul_rate, bandwidth)
  print(f"inference seconds: {infer_seconds}; decode limit {limit:.3f} s", flush=True)
  same_tokens = {name: float((tokens_out[name] == tokens_out["jax"]).mean()) for name in tokens_out}

  train_tokens = s["batch"] * s["length"]
  # The torch baselines the targets use: the faster of its thread counts.
  best_fused = min(step_seconds["torch_fused"], step_seconds["torch_fused_1thread"])
  best_eager = min(infer_seconds["decode_torch_eager"], infer_seconds["decode_torch_eager_1thread"])
  best_eager_prefill = min(infer_seconds["prefill_torch_eager"], infer_seconds["prefill_torch_eager_1thread"])
  results = {
      "meta": meta, "sizes": s, "adamw": ADAMW, "agreement_max_abs_logit_difference": agreement,
      "training": {name: {"step_s": t, "tokens_per_s": train_tokens / t, "vs_torch_fused": best_fused / t}
                   for name, t in step_seconds.items()},
      "prefill": {name[8:]: {"seconds": t, "tokens_per_s": s["batch"] * s["prompt"] / t}
                  for name, t in infer_seconds.items() if name.startswith("prefill_")},
      "decode": {name[7:]: {"seconds": t, "new_tokens_per_s": s["batch"] * s["new_tokens"] / t}
                 for name, t in infer_seconds.items() if name.startswith("decode_")},
      "decode_tokens_equal_to_jax": same_tokens, "torch_compile_note": compile_note,
      "decode_limit": {"step_flops": sum(f for f, _ in work[1]),
                       "step_bytes": sum(b for _, b in work[1]), "matmul_2048_flops_per_s": matmul_rate,
                       "copy_bytes_per_s": bandwidth, "limit_s": limit,
                       "fraction_of_limit": {name[7:]: limit / t for name, t in infer_seconds.items()
                                             if name.startswith("decode_")}},
  }
  results["summary"] = {
      "training_vs_torch_fused_at_default_steps_per_call": best_fused / step_seconds["jax_multi"],
      "training_vs_torch_fused_at_one_step_per_call": best_fused / step_seconds["jax_single"],
      "decode_vs_torch_eager": best_eager / infer_seconds["decode_jax"],
      "decode_vs_torch_compile": (infer_seconds["decode_torch_compile"] / infer_seconds["decode_jax"]
                                  if "decode_torch_compile" in infer_seconds else None),
      "prefill_vs_torch_eager": best_eager_prefill / infer_seconds["prefill_jax"],
      "decode_tensor_parallel_vs_torch_eager": (best_eager / infer_seconds["decode_jax_tensor_parallel"]
                                                if "decode_jax_tensor_parallel" in infer_seconds else None),
      "torch_eager_decode_best_s": best_eager, "torch_eager_prefill_best_s": best_eager_prefill,
  }
  meta["wall_s"] = time.time() - start_time
  meta["contention"] = contention.summary()
  markdown = render(results)
  print(markdown)
  bench_common.write_results(args.out, "lm_benchmark", results, markdown)


def render(r) -> str:
  m, s, t, p, d, sm = r["meta"], r["sizes"], r["training"], r["prefill"], r["decode"], r["summary"]
  k = m["steps_per_call"]
  lines = [
      "# Decoder-only LM benchmark (xattn_jax LanguageModel vs torch)", "",
      f"Commit {m['commit']}, {m['date_utc']} UTC, `{m['command']}`; 1-minute load average before the start "
      f"{m['load_average_before']:.1f} on {m['cores']} cores" + (f" of an {m['cpu']}" if "cpu" in m else "")
      + (" (other jobs shared the machine: absolute numbers are pessimistic, the ratios come from interleaved runs)"
         if m["load_average_before"] > m["cores"] else " (idle)")
      + f"; whole run {m['wall_s'] / 60:.1f} min"
      + (f"; {bench_common.HostContention.describe(m['contention'])}." if "contention" in m else "."),
      f"jax {m['jax']} ({', '.join(m['jax_devices'])}, XLA_FLAGS={m['xla_flags'] or 'unset'}, XLA:CPU's default "
      f"threads), torch {m['torch']} ({m['torch_threads']} intra-op threads, {m['torch_interop_threads']} inter-op), "
      "float32 on both sides.", "",
      f"Model: d_model {s['d_model']}, {s['num_layers']} layers, {s['num_heads']} heads, MLP {s['mlp_dim']}, vocab "
      f"{s['vocab']}; pre-LN (LayerNorm), RoPE (split halves), GELU (tanh) MLP, biases, tied output; the same "
      "weights on both sides (largest |logit difference| of the forward "
      f"{r['agreement_max_abs_logit_difference']['forward_jax_vs_torch']:.1e}; torch's cached steps vs its forward "
      f"{r['agreement_max_abs_logit_difference']['torch_cached_vs_forward']:.1e}).", "",
      f"## Training (batch {s['batch']} x length {s['length']}; forward, cross-entropy, backward, AdamW)", "",
      f"Medians of {s['train_rounds']} interleaved rounds after one warm-up call each. AdamW on both sides: "
      f"lr {r['adamw']['learning_rate']}, betas ({r['adamw']['b1']}, {r['adamw']['b2']}), eps {r['adamw']['eps']}, "
      f"weight decay {r['adamw']['weight_decay']} on every parameter, no clipping.", "",
      "The ratio column divides the faster torch fused-AdamW row's step time by each row's.", "",
      row("", "step s", "tokens/s", "vs torch fused AdamW"), row("---", "---", "---", "---"),
  ]
  labels = {"jax_multi": f"JAX LanguageModel + optax.adamw, {k} steps per call (launch.py's default)",
            "jax_single": "JAX LanguageModel + optax.adamw, 1 step per call",
            "torch_fused": f"torch eager, AdamW(fused=True), {m['torch_threads']} threads",
            "torch_fused_1thread": "torch eager, AdamW(fused=True), 1 thread",
            "torch_default": f"torch eager, AdamW default (per-tensor loop on CPU), {m['torch_threads']} threads"}
  for name, label in labels.items():
    v = t[name]
    ratio = f"**{v['vs_torch_fused']:.2f}x**" if name == "jax_multi" else f"{v['vs_torch_fused']:.2f}x"
    lines.append(row(label, f"{v['step_s']:.3f}", f"{v['tokens_per_s']:.0f}", ratio))
  lines += ["", f"Target: >= 1.0x torch fused AdamW at {k} steps per call: "
            f"**{r['summary']['training_vs_torch_fused_at_default_steps_per_call']:.2f}x** "
            f"({r['summary']['training_vs_torch_fused_at_one_step_per_call']:.2f}x at one step per call).", "",
            f"## Inference (batch {s['batch']}, prompt {s['prompt']}, {s['new_tokens']} greedy new tokens, KV cache)", "",
            f"Medians of {s['decode_rounds']} interleaved rounds after one warm-up run each. Prefill: the prompt into "
            "an empty cache, last-position logits. Decode: the steps after the prefill, one token per row per step "
            f"(capacity {s['prompt'] + s['new_tokens']}). Ratios divide the faster torch eager row's time by each "
            "row's.", "",
            row("", "prefill s", "prefill tokens/s", "decode s", "decode new tokens/s", "decode vs torch eager",
                "prefill vs torch eager", "tokens equal to JAX's"),
            row("---", "---", "---", "---", "---", "---", "---", "---")]
  labels = {"jax": "JAX LanguageModel.prefill + loop_step in decoding.greedy_search (jitted)",
            "jax_kernels_in_out": "the same JAX decode, its kernels as trained ([in, out]; `transpose_kernels=False`)",
            "jax_tensor_parallel": f"the same JAX prefill and decode tensor-parallel over {m.get('tensor_devices')} CPU "
                                   "devices (heads / MLP / vocabulary split, one core each)",
            "torch_eager": f"torch eager, hand-written cache, SDPA, {m['torch_threads']} threads",
            "torch_eager_1thread": "torch eager, hand-written cache, SDPA, 1 thread",
            "torch_compile": "torch.compile(dynamic=True) of each block's cached step, same cache"}
  for name, label in labels.items():
    if name not in d:
      if name not in ("jax_kernels_in_out", "jax_tensor_parallel"):  # (not run, or a record from before the row)
        lines.append(row(label, "-", "-", "-", "-", "-", "-", "-"))
      continue
    prefill = p.get(name)  # (the kernels' layout is the decode's alone)
    lines.append(row(label, f"{prefill['seconds']:.3f}" if prefill else "-",
                     f"{prefill['tokens_per_s']:.0f}" if prefill else "-", f"{d[name]['seconds']:.3f}",
                     f"{d[name]['new_tokens_per_s']:.0f}", f"{sm['torch_eager_decode_best_s'] / d[name]['seconds']:.2f}x",
                     f"{sm['torch_eager_prefill_best_s'] / prefill['seconds']:.2f}x" if prefill else "-",
                     f"{r['decode_tokens_equal_to_jax'].get(name.replace('_1thread', ''), float('nan')):.3f}"))
  if "decode_limit" in r:
    lim = r["decode_limit"]
    fractions = lim["fraction_of_limit"]
    lines += ["", f"This machine's limit for the decode: {_figure(lim['limit_s'], 3)} s "
              f"({_figure(lim['step_flops'] / 1e9, 0)} GFLOP at the 2048^3 matmul's "
              f"{lim['matmul_2048_flops_per_s'] / 1e9:.0f} GFLOP/s, {_figure(lim['step_bytes'] / 1e9, 1)} GB "
              f"at the copy bandwidth {lim['copy_bytes_per_s'] / 1e9:.1f} GB/s, each step the larger; both rates timed "
              "in the same rounds). Share of it reached: " + ", ".join(
                  f"{short} {fractions[name]:.2f}" for name, short in (
                      ("jax", "JAX"), ("jax_kernels_in_out", "JAX with kernels [in, out]"),
                      ("jax_tensor_parallel", "JAX tensor-parallel"),
                      ("torch_eager", f"torch eager {m['torch_threads']} threads"),
                      ("torch_eager_1thread", "torch eager 1 thread"), ("torch_compile", "torch.compile"))
                  if name in fractions) + "."]
  compile_ratio = r["summary"]["decode_vs_torch_compile"]
  tp_ratio = r["summary"].get("decode_tensor_parallel_vs_torch_eager")
  lines += ["", f"Target: decode >= 1.5x torch eager's cached decoder: **{r['summary']['decode_vs_torch_eager']:.2f}x**"
            + (f"; vs torch.compile {compile_ratio:.2f}x" if compile_ratio else "")
            + (f"; tensor-parallel over {m['tensor_devices']} CPU devices **{tp_ratio:.2f}x** (the model placed by "
               "`sharding.place_model` on a (data=1, tensor) mesh, the launcher's default rules; torch runs its "
               f"{m['torch_threads']} threads over the same cores)" if tp_ratio else "") + ".",
            f"torch.compile: {r['torch_compile_note'] or 'not run'}."]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
