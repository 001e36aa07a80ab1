"""Translator speed: training throughput, FLOP/s, cached decoding, beam search, compile time.

Everything is measured in ONE process, side by side, so the ratios hold on a loaded machine:
  (a) training tokens/s (source + target, forward + backward + AdamW) against torch.nn.Transformer
      of identical size and batch (eager, CPU, torch threads = the cores JAX uses);
  (b) the achieved training FLOP/s as a fraction of a float32 2048^3 matmul's FLOP/s;
  (c) greedy decoding tokens/s: the cached jitted decoder against torch.nn.Transformer re-running
      its decoder on the growing prefix; and the once-projected cross-attention cache against
      projecting the memory's keys/values at every step (both in one jitted loop);
  (d) beam search (beam 4) tokens/s;
  (e) compile time of the train step at 2, 6 and 12 layers per stack, with and without
      scan_layers, and the step time of both.
Times are medians of several runs after a warm-up, each ended by block_until_ready; what is compared
as a ratio (JAX vs torch training, scanned vs unrolled steps) runs interleaved, a, b, a, b, ...
Results go to experiments/results/translator_benchmark.{md,json}.

    python experiments/bench_translator.py           # the full sizes (several minutes)
    python experiments/bench_translator.py --quick   # a tiny smoke run
"""
from __future__ import annotations

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
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from configs import common  # noqa: E402
from bench_common import interleaved_median_seconds, median_seconds, output_dir, parse_jax_vs_torch_args  # noqa: E402
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
  holder = {"state": state}
  if steps_per_call is None:
    batch = [jnp.asarray(tokens(rng, s["vocab"], s["batch"], s["length"])) for _ in range(3)]

    def run():
      holder["state"], loss = step(holder["state"], *batch)
      loss.block_until_ready()

    return run
  batches = tuple(jnp.asarray(np.stack([tokens(rng, s["vocab"], s["batch"], s["length"])
                                        for _ in range(steps_per_call)])) for _ in range(3))
  first, count, key = jnp.int32(0), jnp.int32(steps_per_call), jax.random.key(0)

  def run_multi():
    holder["state"], metrics = step(holder["state"], batches, first, count, key)
    metrics["loss"].block_until_ready()

  return run_multi


def decode_functions(model, s):
  """Jitted greedy (cross-attention cache projected once), greedy re-projecting the memory every
  step, and beam search: each (inputs [b, s]) -> tokens."""
  graphdef, state = nnx.split(model)
  never_eos = s["vocab"]  # an id the model cannot emit, so every run decodes new_tokens steps
  common = dict(max_length=s["new_tokens"], bos_id=BOS, eos_id=never_eos)

  def start(state, inputs):
    model = nnx.merge(graphdef, state)
    memory = model.encode(inputs)  # -> [batch, source_length, d_model]
    return model, memory, model.init_cache(memory, inputs != 0, s["new_tokens"])

  @jax.jit
  def greedy(state, inputs):
    model, _, cache = start(state, inputs)
    return decoding.greedy_search(model.loop_step(), cache, batch_size=inputs.shape[0], **common).tokens

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

  @jax.jit
  def beam(state, inputs):
    model, _, cache = start(state, inputs)
    return decoding.beam_search(model.loop_step(), cache, batch_size=inputs.shape[0], beam_size=s["beam"],
                                alpha=0.6, **common).tokens

  return {name: (lambda inputs, f=f: f(state, inputs).block_until_ready())
          for name, f in (("greedy", greedy), ("greedy_reprojecting", greedy_reprojecting), ("beam", beam))}


def matmul_flops_per_second(repeats):
  a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048)), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  seconds = median_seconds(lambda: matmul(a, a).block_until_ready(), max(repeats, 5))
  return 2 * 2048 ** 3 / seconds


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


def torch_training(s, rng):
  torch.manual_seed(0)
  model = TorchTranslator(s)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
  inputs, decoder_inputs, targets = (torch.from_numpy(tokens(rng, s["vocab"], s["batch"], s["length"])).long()
                                     for _ in range(3))

  def run():
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs, decoder_inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, s["vocab"]), targets.reshape(-1))
    loss.backward()
    optimizer.step()

  return run


def torch_greedy(s):
  torch.manual_seed(0)
  model = TorchTranslator(s).eval()

  def run(inputs):
    with torch.inference_mode():
      memory = model.encode(inputs)
      prefix = torch.full((inputs.shape[0], 1), BOS, dtype=torch.long)
      for _ in range(s["new_tokens"]):
        logits = model.decode(prefix, memory)[:, -1]  # the whole prefix again -> [batch, vocab]
        prefix = torch.cat([prefix, logits.argmax(-1, keepdim=True)], dim=1)
    return prefix

  return run


# --- report -------------------------------------------------------------------------------------

def main():
  args, s, cores = parse_jax_vs_torch_args(__doc__, FULL, QUICK)
  # Taken before any work: from here on the benchmark itself keeps the cores busy (load ~2).
  load_before, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M")
  rng = np.random.default_rng(0)
  print(f"sizes: {s}; cores: {cores}; torch threads: {torch.get_num_threads()}", flush=True)

  # (a) + (b)
  # JAX runs one step per call, and launch.py's STEPS_PER_CALL steps per call (time per step = call
  # time / STEPS_PER_CALL): the same updates, but XLA:CPU allocates and page-faults the step's
  # temporaries once per call.
  calls = interleaved_median_seconds({"jax": jax_training(s, rng), "jax_multi": jax_training(s, rng, STEPS_PER_CALL),
                                      "torch": torch_training(s, rng)}, s["repeats"])
  jax_step, torch_step = calls["jax"], calls["torch"]
  multi_step = calls["jax_multi"] / STEPS_PER_CALL
  step_tokens = s["batch"] * 2 * s["length"]
  matmul_rate = matmul_flops_per_second(s["repeats"])
  flops = training_flops(s)
  print(f"train step: jax {jax_step:.3f} s ({multi_step:.3f} s at {STEPS_PER_CALL} steps per call), "
        f"torch {torch_step:.3f} s", flush=True)

  # (c) + (d)
  inputs = tokens(rng, s["vocab"], s["batch"], s["length"])
  jax_decoders = decode_functions(make_translator(s), s)
  jax_inputs = jnp.asarray(inputs)
  torch_inputs = torch.from_numpy(inputs).long()
  torch_decoder = torch_greedy(s)
  # Interleaved like training: decoding runs are separate from torch's, and the machine's speed
  # drifts by several percent over the minute this takes (a greedy run measured 1.17 s in one
  # section and 1.04 s a few minutes later). Torch's run is long (~10 s), so fewer rounds.
  decoders = {name: (lambda f=f: f(jax_inputs)) for name, f in jax_decoders.items()}
  decoders["torch_greedy_rerun"] = lambda: torch_decoder(torch_inputs)
  decode_seconds = interleaved_median_seconds(decoders, s["repeats"] // 2 + 1, warmup=1)
  new_tokens = s["batch"] * s["new_tokens"]
  print(f"decode seconds: {decode_seconds}", flush=True)

  # (e)
  compile_seconds, scan_step_seconds = compile_and_step_times(s, rng)

  layers = s["compile_layers"]
  results = {
      "machine": {"cores": cores, "platform": platform.platform(), "jax": jax.__version__,
                  "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                  "glibc_tunables": os.environ.get("GLIBC_TUNABLES"), "started": started,
                  "load_average_before": load_before},
      "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
      "training": {"jax_step_s": jax_step, "torch_step_s": torch_step,
                   "jax_tokens_per_s": step_tokens / jax_step, "torch_tokens_per_s": step_tokens / torch_step,
                   "ratio_vs_torch": torch_step / jax_step, "steps_per_call": STEPS_PER_CALL,
                   "jax_multi_step_s": multi_step, "jax_multi_tokens_per_s": step_tokens / multi_step,
                   "multi_ratio_vs_torch": torch_step / multi_step},
      "flops": {"train_step_flops": flops, "achieved_flops_per_s": flops / jax_step,
                "matmul_2048_flops_per_s": matmul_rate, "fraction_of_matmul": flops / jax_step / matmul_rate,
                "multi_fraction_of_matmul": flops / multi_step / matmul_rate},
      "decoding": {name: {"seconds": t, "new_tokens_per_s": new_tokens / t} for name, t in decode_seconds.items()},
      "compile_s": {f"layers={n},scan={scan}": c for (n, scan), c in compile_seconds.items()},
      "step_s_at_benchmark_depth": {(k if isinstance(k, str) else f"scan={k}"): t
                                    for k, t in scan_step_seconds.items()},
  }
  decoding_ratio = decode_seconds["torch_greedy_rerun"] / decode_seconds["greedy"]
  cache_ratio = decode_seconds["greedy_reprojecting"] / decode_seconds["greedy"]
  compile_growth = compile_seconds[(layers[-1], True)] / compile_seconds[(layers[0], True)]
  unrolled_growth = compile_seconds[(layers[-1], False)] / compile_seconds[(layers[0], False)]
  scan_slowdown = scan_step_seconds[True] / scan_step_seconds[False]
  remat_slowdowns = {remat: scan_step_seconds[f"scan_remat_{remat}"] / scan_step_seconds[False]
                     for remat in ("dots", "dots_no_batch")}
  results["summary"] = {"decoding_ratio_vs_torch": decoding_ratio, "cross_cache_speedup": cache_ratio,
                        "scan_compile_growth": compile_growth, "unrolled_compile_growth": unrolled_growth,
                        "scan_step_slowdown": scan_slowdown,
                        **{f"scan_remat_{r}_step_slowdown": v for r, v in remat_slowdowns.items()}}

  def row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"

  t = results["training"]
  f = results["flops"]
  d = results["decoding"]
  lines = [
      "# Translator benchmark", "",
      f"{cores} CPU cores ({platform.machine()}), jax {jax.__version__}, torch {torch.__version__} "
      f"({torch.get_num_threads()} threads), float32. Sizes: d_model {s['d_model']}, {s['num_heads']} heads, "
      f"{s['num_layers']}+{s['num_layers']} layers, MLP {s['mlp_dim']}, vocab {s['vocab']}, batch {s['batch']}, "
      f"source/target length {s['length']}. Medians of {s['repeats']} runs after warm-up. "
      f"Run {started} to {time.strftime('%H:%M')}; 1-minute load average before it started: {load_before:.1f} "
      "(well above 0 = other jobs were running, absolute times pessimistic; the run itself then keeps the "
      "cores busy). JAX and torch were measured side by side in one process"
      + (f" (GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']})." if os.environ.get("GLIBC_TUNABLES") else "."), "",
      "## Training (forward + backward + AdamW)", "",
      row("", "step s", "tokens/s (source + target)", "vs torch"), row("---", "---", "---", "---"),
      row(f"xattn_jax Translator, {STEPS_PER_CALL} steps per jitted call (launch.py's default)",
          f"{t['jax_multi_step_s']:.3f}", f"{t['jax_multi_tokens_per_s']:.0f}",
          f"**{t['multi_ratio_vs_torch']:.2f}x** (target >= 1.0x)"),
      row("xattn_jax Translator, one step per call (steps_per_call=1)", f"{t['jax_step_s']:.3f}",
          f"{t['jax_tokens_per_s']:.0f}", f"{t['ratio_vs_torch']:.2f}x"),
      row("torch.nn.Transformer (eager)", f"{t['torch_step_s']:.3f}", f"{t['torch_tokens_per_s']:.0f}", "1.00x"),
      "",
      f"Each step is one batch's forward, backward and AdamW update, {STEPS_PER_CALL} steps per call run the same "
      "updates as one per call; what differs is the per-call cost (dispatch, and XLA:CPU allocating and "
      "page-faulting the step's temporaries), paid once per call instead of once per step.",
      "",
      f"Achieved training FLOP/s at {STEPS_PER_CALL} steps per call: {f['multi_fraction_of_matmul'] * f['matmul_2048_flops_per_s'] / 1e9:.1f} GFLOP/s "
      f"({f['train_step_flops'] / 1e9:.1f} GFLOP per step, matmul FLOPs x 3); float32 2048^3 matmul: "
      f"{f['matmul_2048_flops_per_s'] / 1e9:.1f} GFLOP/s; fraction **{f['multi_fraction_of_matmul']:.2f}** "
      f"(target >= 0.7); one step per call: {f['fraction_of_matmul']:.2f}.",
      "",
      f"## Decoding (batch {s['batch']}, source length {s['length']}, {s['new_tokens']} new tokens, EOS disabled)", "",
      row("", "seconds", "new tokens/s", "vs torch re-run"), row("---", "---", "---", "---"),
  ]
  for name, label in (("greedy", "greedy, cached, jitted (cross-attention K/V projected once)"),
                      ("greedy_reprojecting", "greedy, cached, memory K/V re-projected every step"),
                      ("beam", f"beam search, beam {s['beam']} (tokens of the best beam)"),
                      ("torch_greedy_rerun", "torch.nn.Transformer greedy, decoder re-run on the prefix")):
    lines.append(row(label, f"{d[name]['seconds']:.3f}", f"{d[name]['new_tokens_per_s']:.0f}",
                     f"{decode_seconds['torch_greedy_rerun'] / d[name]['seconds']:.1f}x"))
  lines += ["", f"Cached greedy vs torch re-run: **{decoding_ratio:.1f}x** (target >= 10x). Projecting the "
            f"memory once vs every step: {cache_ratio:.2f}x faster.", "",
            "## Train-step compile time (layers per stack)", "",
            row("layers", "compile s, unrolled", "compile s, scan"), row("---", "---", "---")]
  for n in layers:
    lines.append(row(n, f"{compile_seconds[(n, False)]:.2f}", f"{compile_seconds[(n, True)]:.2f}"))
  lines += ["", f"Compile time at {layers[-1]} layers / {layers[0]} layers: scan **{compile_growth:.2f}x** "
            f"(target <= 1.5x), unrolled {unrolled_growth:.2f}x.", "",
            f"Train step at {s['num_layers']}+{s['num_layers']} layers, all variants interleaved (target: "
            "scanned <= 1.05x unrolled):", "",
            row("variant", "step s", "vs unrolled, no remat"), row("---", "---", "---")]
  for key, label in ((False, "unrolled"), ("unrolled_remat_dots_no_batch", "unrolled, remat=dots_no_batch"),
                     (True, "scan"), ("scan_remat_dots", "scan, remat=dots"),
                     ("scan_remat_dots_no_batch", "scan, remat=dots_no_batch")):
    lines.append(row(label, f"{scan_step_seconds[key]:.3f}",
                     f"**{scan_step_seconds[key] / scan_step_seconds[False]:.3f}**"))
  markdown = "\n".join(lines) + "\n"
  print(markdown)
  out = output_dir(args, "bench_translator")
  (out / "translator_benchmark.md").write_text(markdown)
  (out / "translator_benchmark.json").write_text(json.dumps(results, indent=2) + "\n")
  print(f"wrote {out}/translator_benchmark.md")


if __name__ == "__main__":
  main()
