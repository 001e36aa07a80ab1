"""The three connectors on one frozen image encoder and one frozen LM: accuracy, cost, and how both grow with M.

    python experiments/compare_connectors.py                      # 3 connectors x 3 seeds (~100 minutes on 2 cores)
    python experiments/compare_connectors.py --seeds 0 --steps 300  # a shorter sweep (default: each connector's)
    python experiments/compare_connectors.py --quick              # smoke run: tiny chain, a temporary directory
    python experiments/compare_connectors.py --connectors llava,llava/merge=2 --seeds 0  # variants of a connector
    python experiments/compare_connectors.py --cost_only --scales 1,2,3  # only the cost rows: minutes, no training
    python experiments/compare_connectors.py --scale 2 --workdirs workdirs/compare_connectors_x2  # resized images

Every run is configs/vlm_digits.py:connector=C (seed S) trained in this process (`loop.run`) on the SAME
frozen parts (--encoder / --lm workdirs, trained first by their configs when empty). It evaluates on the
validation split as it trains (data.eval_split), and once finished on the test split (`--mode=eval
--config.data.eval_split=test`, kept in its workdir's test_metrics.json). Per connector and seed:
test exact match and chrF (all targets, and by digits in the image), validation exact match (what a
choice between settings may read; test only reports), trainable parameters, training steps
per second (the loop's own figure), generation tokens / s (greedy over the eval targets, after a warm-up
pass) and, per image size k = 1..4 digits (M = 1 + 16 k features with 2 x 2 patches), the tokens an image
hands the LM and the median forward time of a batch of k-digit examples, and the wall time of the run
(training and its final eval). The ceiling is a probe (`xattn_jax.tasks.vlm.probe`) trained on the same
frozen features (--probe_steps batches of 64 fresh train strips; by default the most steps of a connector) to
read each strip's digits, scored on the same test targets by the answers its reading implies. A second
probe, trained alike with a head that predicts the sum directly, answers the sum question as the connectors
must (learned, not added up). The frozen encoder's own test strip accuracy is listed beside them. Each run is
also scored on the test split answering in two passes (`task.describe_first`: it describes each image, then the
frozen LM answers from the description), a second table. Results: experiments/results/compare_connectors.{md,json}.

Cost as the image grows, per connector (once, on its first seed's config; `--scales`): for k = 1..4 digits at
each image scale s (digits of 8s x 8s pixels, so M = 1 + 16 k s^2 with 2 x 2 patches), the tokens an image
hands the LM, the trainable parameters and the median ms of a forward and of a training step's forward +
backward on a batch of k-digit captions. The frozen parts there are at random weights shaped for the s-times
canvas, since the times depend on the shapes only. `--cost_only` measures these rows alone:
experiments/results/vlm_cost_by_scale.{md,json}.

Accuracy as the image is resized: `--scale s` runs every connector, and the probe, on digits of 8s x 8s pixels
(M = 1 + 16 k s^2 features), read by an encoder trained at that scale (configs/vlm_encoder.py:scale=s, in
workdirs/vlm_encoder_xs unless --encoder names another), the same frozen LM.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from experiments import bench_common, sweep  # noqa: E402

# The default comparison: every connector of models/connectors.py, named here so that --help imports no JAX (a test
# keeps the two lists equal).
CONNECTORS = ("flamingo", "qformer", "llava")
# The flags --quick sets itself (its tiny chain in --out, seed 0, 40 steps, a 30-step probe, 32 test examples).
QUICK_SETS = ("seeds", "steps", "workdirs", "encoder", "lm", "probe_steps", "eval_examples")


def other_test_set(workdir: str, eval_examples: int) -> str:
  """Why a finished run in workdir cannot join a comparison on eval_examples test examples ("" if it can):
  its final metrics were measured on another number of them."""
  if not pathlib.Path(workdir, "wall_seconds.json").is_file():
    return ""  # not finished: it trains with this comparison's config
  evaluated = json.loads(pathlib.Path(workdir, "config.json").read_text())["data"]["num_eval_examples"]
  if evaluated == eval_examples:
    return ""
  return (f"the finished run in {workdir} answered {evaluated} test examples, not {eval_examples}; use another "
          "--workdirs")


def other_run(workdir: str, config) -> str:
  """Why the finished run in workdir is not the run `config` would train ("" if it is): the first field both
  record with different values (a field one of them predates is not compared; the test set is
  `other_test_set`'s). Without this a run of another budget would be reported under this one's."""
  from xattn_jax.training import workdir as workdir_lib
  differences = {field: values for field, values in workdir_lib.config_differences(config, workdir).items()
                 if None not in values and field != "data.num_eval_examples"}
  if not differences:
    return ""
  # the budget first: the eval and checkpoint intervals follow from it
  field = min(differences, key=lambda name: (name not in ("total_steps", "batch_size", "optimizer.learning_rate"), name))
  trained, configured = differences[field]
  return (f"the finished run in {workdir} was trained with {field}={trained!r}, this comparison's config has "
          f"{configured!r}: it is another run; use another --workdirs")


def test_metrics(workdir: str, describe_first: bool = False) -> dict:
  """The finished run's eval metrics on the test split, as `launch.py --mode=eval --config.data.eval_split=test`
  gives them (and records), computed once and kept in workdir/test_metrics.json; describe_first: answered in
  two passes (`--config.task.describe_first=true`), kept in workdir/test_metrics_describe_first.json. A run
  whose config predates data.eval_split evaluated on test already."""
  from xattn_jax.training import loop, validation
  path = pathlib.Path(workdir, "test_metrics_describe_first.json" if describe_first else "test_metrics.json")
  if path.is_file():
    return json.loads(path.read_text())
  config = validation.load_config_file(os.path.join(workdir, "config.py"))
  config.data.eval_split = "test"
  if describe_first:
    with config.unlocked():  # a run's config.py written before the field existed has none
      config.task.describe_first = True
  metrics = {k: float(v) for k, v in loop.run(config, workdir, "eval").items()}
  path.write_text(json.dumps(metrics))
  return metrics


def _final_metrics(workdir: str) -> dict:
  rows = [json.loads(line) for line in pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines()]
  merged = {}
  for row in rows:
    merged.update(row)
  merged["train/steps_per_second"] = statistics.median(
      [r["train/steps_per_second"] for r in rows if "train/steps_per_second" in r])
  return merged


def _measure(config, workdir: str) -> dict:
  """Trainable parameters, generation tokens / s and per-size token counts and forward times of a trained run."""
  import jax
  import numpy as np
  from flax import nnx
  from xattn_jax.models import vlm
  from xattn_jax.training import inference
  model, task = inference.load_model(workdir, mode="eval")
  requests = [(example.images, layout.ids[:prefix].tolist(), stop)
              for example, layout in zip(task.eval_examples, task.eval_layouts) for prefix, stop, _ in layout.targets]
  task.generate(model, requests)  # warm-up: compiles
  start = time.perf_counter()
  texts = task.generate(model, requests)
  seconds = time.perf_counter() - start
  generated = sum(len(task.tokenizer.encode(t)) + 1 for t in texts)  # the words and the token that ends them
  forward = nnx.jit(lambda m, b: task._logits(m, b))
  by_size = {}
  for k in range(1, config.data.max_digits + 1):
    rows = [i for i, e in enumerate(task.eval_examples) if e.num_digits == k and len(e.images) == 1]
    if not rows:
      continue
    rows = (rows * config.eval_batch_size)[:config.eval_batch_size]
    batch = task._rows(task.eval_examples, task.eval_layouts, np.asarray(rows))
    length = int(batch["valid"].sum(axis=1).max())  # rows cut to this size's own length: cost grows with M
    for key in ("tokens", "labels", "weights", "valid"):
      batch[key] = batch[key][:, :length]
    times = []
    for repeat in range(4):
      begin = time.perf_counter()
      jax.block_until_ready(forward(model, batch))
      times.append(time.perf_counter() - begin)
    image = task.eval_examples[rows[0]].images[0]
    by_size[k] = {"M": 1 + (image.shape[0] // task.patch_size) * (image.shape[1] // task.patch_size),
                  "tokens_to_lm": task.slots(image) + 1, "forward_ms": 1000 * statistics.median(times[1:])}
  return {"trainable_parameters": vlm.trainable_parameters(model), "generation_tokens_per_second": generated / seconds,
          "by_size": by_size}


def _cost_by_scale(task, scales, digits: int) -> list[dict]:
  """Per image scale s and digit count k: M, the tokens an image hands the LM, trainable parameters, and the median
  ms (5 rounds interleaved over k, after compiling) of a forward and of a training step's forward + backward (the
  connector's gradients) on a batch of k-digit captions at batch_size, the step from pixels (the encoder inside)
  and from the cached features training reads (data.cache_features). The frozen parts are at random weights, the
  encoder's position table sized for the s-times canvas: the times depend on the shapes only, so no encoder is
  trained per scale."""
  import copy
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from ml_collections import ConfigDict
  from xattn_jax.data import vlm_digits
  from xattn_jax.models import vlm
  data, rows = task.config.data, []
  for scale in scales:
    twin = copy.copy(task)
    twin.encoder_model = ConfigDict(task.encoder_model.to_dict())
    height, width = (int(n) // data.scale for n in task.encoder_model.grid.split("x"))  # the grid at scale 1
    twin.encoder_model.grid = f"{height * scale}x{width * scale}"
    twin.canvas, twin.weights = vlm_digits.canvas_for(data.max_digits, scale), None
    # the cross-entropy step: task.distill_weight adds a squared error over states the pass computes anyway,
    # read from states cached before training (its steps/s is in the trained runs' rows)
    twin.distill_weight = 0.0
    model = twin.make_model(nnx.Rngs(params=0), dtype=jnp.float32, param_dtype=jnp.float32)
    examples = vlm_digits.make_examples("test", 16 * digits, data.eval_seed, max_digits=digits, kinds=("caption",),
                                        scale=scale)
    layouts = [twin.layout(e) for e in examples]
    twin.length = max(len(layout.ids) for layout in layouts)
    forward = nnx.jit(lambda m, b: twin._logits(m, b))
    gradients = nnx.jit(lambda m, b: nnx.grad(lambda m: twin.loss(m, b, rngs=None)[0])(m))
    batches = {}
    for k in range(1, digits + 1):
      index = next(i for i, e in enumerate(examples) if e.num_digits == k)
      batch = twin._rows(examples, layouts, np.full(task.config.batch_size, index))
      length = int(batch["valid"].sum(axis=1).max())
      for key in ("tokens", "labels", "weights", "valid"):
        batch[key] = batch[key][:, :length]
      batches[k] = (examples[index].images[0], batch)
    read = nnx.jit(lambda m, b: vlm.frozen_features(m.encoder, b["images"], b["pixel_valid"], b["image_valid"],
                                                    hide_padding=m.hide_padding, dtype=jnp.float32)[0])
    pixels = {k: batch for k, (_, batch) in batches.items()}
    cached = {k: {**{key: v for key, v in batch.items() if key != "images"}, "features": read(model, batch)}
              for k, batch in pixels.items()}
    functions = (("forward_ms", forward, pixels), ("train_step_ms", gradients, pixels),
                 ("cached_step_ms", gradients, cached))
    for k in batches:  # compile every shape first
      for _, fn, inputs in functions:
        jax.block_until_ready(fn(model, inputs[k]))
    times = {(k, name): [] for k in batches for name, _, _ in functions}
    for _ in range(5):  # interleaved rounds: a slow moment of the host spreads over every size
      for k in batches:
        for name, fn, inputs in functions:
          begin = time.perf_counter()
          jax.block_until_ready(fn(model, inputs[k]))
          times[k, name].append(time.perf_counter() - begin)
    for k, (image, _) in batches.items():
      rows.append({"scale": scale, "digits": k, "M": 1 + (image.shape[0] // task.patch_size) *
                   (image.shape[1] // task.patch_size), "tokens_to_lm": twin.slots(image) + 1,
                   "trainable_parameters": vlm.trainable_parameters(model),
                   **{name: 1000 * statistics.median(times[k, name]) for name, _, _ in functions}})
  return rows


def _cost(config, scales, digits: int | None = None) -> list[dict]:
  """_cost_by_scale for config's connector (up to `digits`, default all), its task built on the finished frozen
  parts."""
  from xattn_jax.tasks.vlm import task as vlm_task
  config = config.copy_and_resolve_references()
  config.data.num_train_examples = config.batch_size  # the task is built for its shapes only
  return _cost_by_scale(vlm_task.VLMTask(config, None, "train"), scales, digits or config.data.max_digits)


def _probe(config, args, steps: int) -> dict:
  """The probe's exact match on the connectors' test examples (see the module docstring)."""
  from xattn_jax.data import vlm_digits
  from xattn_jax.tasks.vlm import probe as probe_lib
  data = config.data
  encoder = probe_lib.load_encoder(args.encoder)
  examples = {split: vlm_digits.make_examples(split, data.num_eval_examples, data.eval_seed,
                                             max_digits=data.max_digits, kinds=tuple(data.kinds.split(",")),
                                             scale=data.scale) for split in ("test", "validation")}
  probe, seconds = probe_lib.train_probe(encoder, max_digits=data.max_digits, scale=data.scale, steps=steps)
  def scored(probe=None):
    test, validation = (probe_lib.probe_metrics(encoder, examples[split], max_digits=data.max_digits,
                                                scale=data.scale, probe=probe) for split in ("test", "validation"))
    return {**{f"eval/{k}": v for k, v in test.items()}, "validation/exact_match": validation["exact_match"]}
  direct, direct_seconds = probe_lib.train_probe(encoder, max_digits=data.max_digits, scale=data.scale, steps=steps,
                                                 direct_sum=True)
  return {"steps": steps, "train_seconds": seconds, **scored(probe), "encoder_head": scored(),
          "direct_sum": {"train_seconds": direct_seconds, **scored(direct)}}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--connectors", default=",".join(CONNECTORS),
                      help="connectors, each optionally with configs/vlm_digits.py arguments after slashes "
                           "(llava/merge=2/positions=mrope)")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--steps", type=int, default=None,
                      help="connector steps (default: each connector's, configs/vlm_digits.py's DEFAULT_STEPS)")
  parser.add_argument("--scale", type=int, default=1,
                      help="every run's image scale (digits of 8s x 8s pixels) and so its frozen encoder's")
  parser.add_argument("--encoder", default="",
                      help="the frozen encoder's workdir (default: the config's, workdirs/vlm_encoder[_xS])")
  parser.add_argument("--lm", default="workdirs/vlm_lm")
  parser.add_argument("--workdirs", default="workdirs/compare_connectors")
  parser.add_argument("--probe_steps", type=int, default=None,
                      help="steps of each probe (default: the most steps of a connector; the learned sum needs them)")
  parser.add_argument("--eval_examples", type=int, default=0,
                      help="test examples every run and the probes answer (0: configs/vlm_digits.py's 256; more make "
                           "a gap of 0.03 larger than the sampling error)")
  parser.add_argument("--scales", default="1,2",
                      help="image scales of the cost rows (each connector once, on the first seed's config)")
  parser.add_argument("--cost_only", action="store_true",
                      help="only the cost rows, at random weights (no training, no probe): vlm_cost_by_scale.{md,json}")
  bench_common.add_output_flags(parser)
  args = bench_common.parse_output_args(parser, "compare_connectors", argv)
  unused = [f"--{flag}={getattr(args, flag)}" for flag in QUICK_SETS
            if args.quick and getattr(args, flag) != parser.get_default(flag)]
  if unused:  # as sweep.seeds_to_run says of --seeds
    print(f"--quick sets its own tiny chain, seed and budget: {' '.join(unused)} not used", flush=True)
  record = {"provenance": bench_common.provenance(argv), "runs": []}
  if any(option.startswith("scale=") for connector in args.connectors.split(",") for option in connector.split("/")):
    parser.error("--connectors: set the image scale with --scale (one frozen encoder and probe a comparison)")
  from configs import vlm_digits  # after argument parsing: --help stays fast
  from xattn_jax.training import dependencies, loop
  workdirs = pathlib.Path(args.workdirs if not args.quick else os.path.join(args.out, "workdirs"))
  extra = {}
  if args.quick:
    args.steps, args.seeds = 40, "0"
    extra = {"encoder_config": "steps=30,width=32,blocks=1", "lm_config": "steps=30,size=micro"}  # added arguments
    args.encoder, args.lm = str(workdirs / "encoder"), str(workdirs / "lm")
  def run_config(connector: str, seed: int):
    steps = "" if args.steps is None else f",steps={args.steps}"
    name, *options = connector.split("/")
    config = vlm_digits.get_config(",".join([f"connector={name}{steps}", *options, f"scale={args.scale}",
                                             f"encoder={args.encoder}", f"lm={args.lm}"]))
    config.seed = seed
    for key, arguments in extra.items():  # the config's own frozen parts (at its scale), smaller
      spec = config.model[key]
      config.model[key] = spec + ("," if ":" in spec else ":") + arguments
    if args.eval_examples:
      config.data.num_eval_examples = args.eval_examples
    if args.quick:
      config.data.num_train_examples, config.data.num_eval_examples = 200, 32
      config.batch_size, config.eval_batch_size = 16, 32
    return config

  from xattn_jax.training import checkpoints, validation
  connectors = args.connectors.split(",")
  try:
    seeds, scales = [int(s) for s in args.seeds.split(",")], [int(s) for s in args.scales.split(",")]
  except ValueError as error:
    parser.error(f"--seeds / --scales: comma-separated integers ({error})")
  sweep.check_seeds(args.seeds, len(seeds), parser)
  if not all(0 <= seed < 2**32 for seed in seeds):  # validation sees the first seed's config alone
    parser.error(f"--seeds={args.seeds}: each seed must be a non-negative integer below 2**32")
  # Each told before the frozen parts train: a repeated seed or connector was a second run of the same workdir that
  # counted twice in the table's mean; a scale below 1 or a probe of fewer than 1 step failed after the training.
  for flag, values in (("connectors", connectors), ("seeds", seeds), ("scales", scales)):
    if len(set(values)) < len(values):
      parser.error(f"--{flag}={getattr(args, flag)}: names a value twice; each value is one run of the table")
  if min(scales) < 1:
    parser.error(f"--scales={args.scales}: image scales must be integers >= 1")
  if not args.quick and args.probe_steps is not None and args.probe_steps < 1:
    parser.error(f"--probe_steps={args.probe_steps}: must be >= 1 (or left out: the most steps of a connector)")
  for connector in connectors:  # before the frozen parts train: a bad name fails in seconds, in one line
    try:
      validation.validate_config(run_config(connector, seeds[0]))
    except (validation.ConfigError, ValueError, KeyError) as error:
      parser.error(f"--connectors {connector}: {error}")
  workdir_of = lambda connector, seed: str(workdirs / f"{connector.replace('/', '_')}_seed{seed}")
  first = run_config(connectors[0], seeds[0])
  args.encoder = first.model.encoder_workdir
  patch = dependencies.load_config(first.model.encoder_config, "model.encoder_config").model.patch_size
  record["scale"], record["patches_per_digit"] = args.scale, (8 * args.scale // patch) ** 2
  record["cost"] = {}
  if args.cost_only:  # random weights shaped as the frozen parts: nothing trains
    for connector in connectors:
      record["cost"][connector] = _cost(run_config(connector, seeds[0]), scales)
      print(json.dumps({connector: record["cost"][connector]}), flush=True)
      _write(record, args, stem="vlm_cost_by_scale")
    return
  dependencies.resolve(first, workdir_of(connectors[0], seeds[0]), "train",  # the frozen parts, as launch.py does
                       side_by_side=True)
  workdirs.mkdir(parents=True, exist_ok=True)
  probe_file = workdirs / "probe.json"  # the probe of these frozen parts, measured once
  # by default the largest of the connectors' budgets
  probe_steps = 30 if args.quick else args.probe_steps or max(run_config(c, seeds[0]).total_steps for c in connectors)
  stored = json.loads(probe_file.read_text()) if probe_file.is_file() else {}
  eval_examples = first.data.num_eval_examples
  if stored.get("encoder") == os.path.abspath(args.encoder) and stored.get("steps") == probe_steps and \
      stored.get("eval_examples", 256) == eval_examples:
    record["probe"] = stored
  else:
    record["probe"] = {"encoder": os.path.abspath(args.encoder), "eval_examples": eval_examples,
                       **_probe(first, args, probe_steps)}
    probe_file.write_text(json.dumps(record["probe"]))
  print(json.dumps({"probe": record["probe"]}), flush=True)
  # Seed-major: every connector's first seed runs first, and the results files are rewritten after each run,
  # so a sweep stopped early still compares all three. A run whose workdir records its training wall time
  # finished: it is measured again, not retrained.
  for seed in seeds:
    for connector in connectors:
      config = run_config(connector, seed)
      workdir = workdir_of(connector, seed)
      wall_file = pathlib.Path(workdir, "wall_seconds.json")
      mismatch = other_test_set(workdir, eval_examples)
      if mismatch:
        parser.error(f"--eval_examples: {mismatch}")
      mismatch = other_run(workdir, config) if wall_file.is_file() else ""
      if mismatch:
        parser.error(f"--connectors {connector}: {mismatch}")
      if not wall_file.is_file():
        partial_file = pathlib.Path(workdir, "wall_seconds_so_far.json")  # a run stopped and resumed: its parts
        start = time.perf_counter() - (json.loads(partial_file.read_text()) if partial_file.is_file() else 0.0)
        dependencies.resolve(config, workdir, "train")
        loop.run(config, workdir, "train")
        if checkpoints.step_numbers(workdir)[-1:] != [config.total_steps]:  # stopped (SIGTERM, Ctrl-C): resumable
          partial_file.write_text(json.dumps(time.perf_counter() - start))
          print(f"compare_connectors.py: the run in {workdir} stopped before its {config.total_steps} steps; the "
                "same command resumes it", file=sys.stderr)
          return
        wall_file.write_text(json.dumps(time.perf_counter() - start))
        partial_file.unlink(missing_ok=True)
      metrics = _final_metrics(workdir)  # the training's own: its last eval is on validation
      run = {"connector": connector, "seed": seed, "steps": config.total_steps,
             "wall_seconds": json.loads(wall_file.read_text()),
             "train/steps_per_second": metrics["train/steps_per_second"],
             "validation/exact_match": metrics["eval/exact_match"],
             **{k: v for k, v in test_metrics(workdir).items() if k.startswith("eval/")},
             **{"described/" + k[len("eval/"):]: v for k, v in test_metrics(workdir, describe_first=True).items()
                if k.startswith("eval/exact_match")},
             **_measure(config, workdir)}
      record["runs"].append(run)
      print(json.dumps(run), flush=True)
      if connector not in record["cost"]:
        record["cost"][connector] = _cost(config, scales)
      _write(record, args)


def _write(record: dict, args, stem: str = "compare_connectors"):
  """experiments/results/<stem>.{json,md} (or under --out) of the runs so far."""
  if record["runs"]:  # the cost rows alone read random weights: no encoder to score
    record["encoder_strip_accuracy"] = test_metrics(args.encoder).get("eval/strip_accuracy")
  record["load_average_after"] = os.getloadavg()[0]
  stem = os.path.join(args.out, stem)
  with open(stem + ".json", "w") as f:
    json.dump(record, f, indent=1, default=float)
  text = render(record)
  with open(stem + ".md", "w") as f:
    f.write(text)
  print(text, flush=True)


def render_cost(cost: dict) -> list[str]:
  """The cost rows of every connector: how tokens and time grow with the digits and the image's scale."""
  lines = ["Cost as the image grows: k digits at scale s (each digit 8s x 8s pixels), on the frozen parts' shapes at "
           "random weights (times depend on shapes only); a batch of batch_size k-digit captions, medians of 5 rounds "
           "interleaved over k. M: features the encoder hands on; tokens: what one image takes in the LM's "
           "sequence; step: forward + backward of the connector's gradients, from pixels (the frozen encoder inside) "
           "and from cached features (what training runs, data.cache_features); the cross-entropy alone (a "
           "connector trained with task.distill_weight adds a squared error over states the pass computes).", "",
           "| connector | scale | k | M | tokens to the LM | trainable params | forward ms | step ms | cached step ms |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for connector, rows in cost.items():
    for r in rows:
      cached = f"{r['cached_step_ms']:.1f}" if "cached_step_ms" in r else "n/a"  # records before it existed
      lines.append(f"| {connector} | {r['scale']} | {r['digits']} | {r['M']} | {r['tokens_to_lm']} | "
                   f"{r['trainable_parameters']:,} | {r['forward_ms']:.1f} | {r['train_step_ms']:.1f} | {cached} |")
  return lines


def render(record: dict) -> str:
  runs, p = record["runs"], record["provenance"]
  def mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else float("nan")
  header = [f"{bench_common.provenance_line(p, 10)} {p['cpu_cores']} CPU cores shared with other jobs (1-minute load "
            f"average {record['load_average_after']:.1f} after).", ""]
  if not runs:  # --cost_only
    return "\n".join(["# Three connectors into one frozen LM: cost as the image grows", "", *header,
                      *render_cost(record.get("cost", {}))]) + "\n"
  scale = record.get("scale", 1)
  title = "digit strips" + (f", each digit {8 * scale} x {8 * scale} pixels" if scale != 1 else "")
  lines = [f"# Three connectors into one frozen LM ({title})", "", *header,
           f"Ceiling: a probe trained {record['probe']['steps']} steps ({record['probe']['train_seconds']:.0f} s) on "
           f"the same frozen features reads each test image's digits, and the encoder's own position head reads "
           f"them too; each is scored on the connectors' test targets (those of "
           f"{record['probe'].get('eval_examples', 256)} test examples) by the answers its reading implies "
           f"(`xattn_jax/tasks/vlm/probe.py`; the \"larger\" question follows from the reference captions its "
           f"prompt holds). The ceiling is the higher of the two. A second probe, trained alike with a head that "
           f"predicts the sum of the digits directly from the positions' states, answers the sum question as the "
           f"connectors must (learned, not added up from the digits read); its other answers are its reading's. "
           f"The frozen encoder's strip accuracy (every position of its own test strips right): "
           f"{record['encoder_strip_accuracy']:.3f}. Every column but \"validation\" is on the test split; the runs "
           f"evaluated on the validation split as they trained, and a choice between settings reads that column.",
           "",
           "| model | seeds | steps | wall s | exact match | validation | chrF (0-100) | 1-2 digits | trainable params "
           "| steps/s | generation tok/s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  probe = record["probe"]
  for connector in dict.fromkeys(r["connector"] for r in runs):
    rs = [r for r in runs if r["connector"] == connector]
    small = mean([mean([r.get("eval/exact_match_1digits"), r.get("eval/exact_match_2digits")]) for r in rs])
    lines.append(f"| {connector} | {len(rs)} | {rs[0]['steps']} | {mean([r['wall_seconds'] for r in rs]):.0f} | "
                 f"{mean([r['eval/exact_match'] for r in rs]):.3f} | "
                 f"{mean([r.get('validation/exact_match') for r in rs]):.3f} | "
                 f"{mean([r['eval/chrf'] for r in rs]):.1f} | {small:.3f} | {rs[0]['trainable_parameters']:,} | "
                 f"{mean([r['train/steps_per_second'] for r in rs]):.1f} | "
                 f"{mean([r['generation_tokens_per_second'] for r in rs]):.0f} |")
  direct, head = probe.get("direct_sum"), probe["encoder_head"]
  references = [("probe on the frozen features", probe, probe["train_seconds"]),
                *([("probe with a direct sum head", direct, direct["train_seconds"])] if direct else []),
                ("the encoder's own head", head, None)]
  for name, entry, seconds in references:
    trained = "| | |" if seconds is None else f"1 | {probe['steps']} | {seconds:.0f} |"
    lines.append(f"| {name} | {trained} {entry['eval/exact_match']:.3f} | "
                 f"{mean([entry.get('validation/exact_match')]):.3f} | | "
                 f"{mean([entry.get('eval/exact_match_1digits'), entry.get('eval/exact_match_2digits')]):.3f} | | | |")
  described = [c for c in dict.fromkeys(r["connector"] for r in runs)
               if all("described/exact_match" in r for r in runs if r["connector"] == c)]
  if described:
    ceiling = max(probe["eval/exact_match"], head["eval/exact_match"])
    lines += ["", "Describe first (`--config.task.describe_first=true`, the same runs): each image is described "
              "alone, then the frozen LM alone answers from the text with the description before the image's "
              "marker (a target right after an image is its description); the default answers from the image.", "",
              "| model | seeds | exact match: default / describe first | below the ceiling | sum | 1-2 digits |",
              "| --- | --- | --- | --- | --- | --- |"]
    for connector in described:
      rs = [r for r in runs if r["connector"] == connector]
      default, first = mean([r["eval/exact_match"] for r in rs]), mean([r["described/exact_match"] for r in rs])
      small = [mean([mean([r.get(f"{side}/exact_match_1digits"), r.get(f"{side}/exact_match_2digits")]) for r in rs])
               for side in ("eval", "described")]
      lines.append(f"| {connector} | {len(rs)} | {default:.3f} / **{first:.3f}** | {ceiling - default:.3f} / "
                   f"{ceiling - first:.3f} | {mean([r.get('eval/exact_match_sum') for r in rs]):.2f} / "
                   f"{mean([r.get('described/exact_match_sum') for r in rs]):.2f} | {small[0]:.3f} / {small[1]:.3f} |")
  lines += ["", "By image size (first seed): tokens an image hands the LM / median forward ms of an eval batch / "
            "exact match", "", "| connector | " + " | ".join(f"k={k}" for k in range(1, 5)) + " |",
            "| --- |" + " --- |" * 4]
  for connector in dict.fromkeys(r["connector"] for r in runs):
    r = next(r for r in runs if r["connector"] == connector)
    cells = []
    for k in range(1, 5):
      size = r["by_size"].get(k) or r["by_size"].get(str(k))
      match = r.get(f"eval/exact_match_{k}digits")
      cells.append("n/a" if size is None else f"{size['tokens_to_lm']} / {size['forward_ms']:.1f} / "
                   f"{match if match is None else round(match, 3)}")
    lines.append(f"| {connector} | " + " | ".join(cells) + " |")
  kinds = sorted(k[len("eval/exact_match_"):] for k in probe if k.startswith("eval/exact_match_")
                 and not k.endswith("digits"))
  lines += ["", "Exact match by number of digits in the (largest) image and by kind (mean over seeds)", "",
            "| model | " + " | ".join([f"k={k}" for k in range(1, 5)] + kinds) + " |",
            "| --- |" + " --- |" * (4 + len(kinds))]
  keys = [f"eval/exact_match_{k}digits" for k in range(1, 5)] + [f"eval/exact_match_{kind}" for kind in kinds]
  for connector in dict.fromkeys(r["connector"] for r in runs):
    rs = [r for r in runs if r["connector"] == connector]
    lines.append(f"| {connector} | " + " | ".join(f"{mean([r.get(key) for r in rs]):.3f}" for key in keys) + " |")
  for name, entry, _ in references:
    lines.append(f"| {name} | " + " | ".join(f"{mean([entry.get(key)]):.3f}" for key in keys) + " |")
  scale, per_digit = record.get("scale", 1), record.get("patches_per_digit", 16)
  lines += ["", f"Flamingo hands the LM one marker per image; its gated layers read the latents of its Perceiver "
            f"resampler (configs/vlm_digits.py's latents; latents=0: every canvas feature, 1 + {4 * per_digit} on the "
            f"{8 * scale} x {32 * scale} canvas) whatever k. Q-Former: N soft tokens + "
            f"marker; LLaVA: one soft token per real patch ({per_digit} k) + marker, or with merge=m one per m x m "
            f"block of patches ({per_digit} k / m^2) + marker."]
  if record.get("cost"):
    lines += ["", *render_cost(record["cost"])]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
