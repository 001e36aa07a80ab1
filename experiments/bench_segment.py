"""What SAM's split into encoder and decoder buys: the cost of one more click, decoded from cached
image features, against re-encoding the image for every click.

The model is the default `configs/segment_digits.py` segmenter (ViT encoder of 3 blocks, width 64, 4x4
patches; two two-way blocks, width 64), freshly initialised (the cost does not depend on the weights).
One image, one click prompt at a time, as in an interactive session. For each canvas side (the ViT's
learned position table is resized, so M = (side / 4)^2 features) three jitted functions are timed,
in alternating blocks of back-to-back calls (bench_common.blocked_median_seconds), median after warm-up,
each result `block_until_ready`:
  encode:  images -> ImageFeatures (once per image);
  decode:  (ImageFeatures, click) -> masks, IoU (once per click);
  full:    images, click -> masks, IoU (encode + decode in one program: re-encoding every click).
The ratio full / decode is how many clicks the cached features decode in the time of one re-encoded click.

    python experiments/bench_segment.py            # sides 32, 64, 128 -> experiments/results/segment_benchmark.{md,json}
    python experiments/bench_segment.py --quick    # side 32 only, into a temporary directory
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from bench_common import (add_output_flags, blocked_median_seconds, commit_label, parse_output_args,  # noqa: E402
                          provenance as run_provenance, provenance_line)

FULL = {"sides": (32, 64, 128), "blocks": 10, "per_block": 10}
QUICK = {"sides": (32,), "blocks": 2, "per_block": 3}


def time_side(side: int, sizes: dict) -> dict:
  """Median seconds of encode, decode and full at one canvas side, and the model's feature count M."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from configs import segment_digits as segment_config
  from xattn_jax.data import segment_digits
  from xattn_jax.models import segmenter

  config = segment_config.get_config()
  model_config, canvas = config.model, config.data.canvas
  grid = (canvas // model_config.patch_size,) * 2
  model = segmenter.Segmenter(
      patch_size=model_config.patch_size, grid=grid, encoder_width=model_config.encoder.d_model,
      encoder_heads=model_config.encoder.num_heads, encoder_blocks=model_config.encoder.num_blocks,
      encoder_mlp_ratio=model_config.encoder.mlp_ratio, freeze_encoder=False, width=model_config.d_model,
      num_heads=model_config.num_heads, num_blocks=model_config.num_blocks, mlp_features=model_config.mlp_dim,
      num_masks=config.task.num_masks, mask_features=model_config.mask_features,
      num_point_labels=segment_digits.NUM_POINT_LABELS, rngs=nnx.Rngs(params=0, dropout=0))
  rng = np.random.default_rng(side)
  images = jnp.asarray(rng.uniform(size=(1, side, side, 1)), jnp.float32)
  points = jnp.asarray([[[0.4, 0.6], [0.0, 0.0], [0.0, 0.0]]], jnp.float32)
  labels = jnp.asarray([[segment_digits.POSITIVE, 0, 0]], jnp.int32)
  # Plain jax.jit over the split state: the least per-call overhead (nnx.jit walks the module graph on
  # every call), which matters for calls of a millisecond or two.
  graphdef, state = nnx.split(model)
  encode = jax.jit(lambda state, x: nnx.merge(graphdef, state).encode(x))
  decode = jax.jit(lambda state, f, p, l: nnx.merge(graphdef, state).decode(f, p, l))
  full = jax.jit(lambda state, x, p, l: nnx.merge(graphdef, state)(x, p, l))
  features = encode(state, images)
  seconds = blocked_median_seconds({
      "encode": lambda: jax.block_until_ready(encode(state, images)),
      "decode": lambda: jax.block_until_ready(decode(state, features, points, labels)),
      "full": lambda: jax.block_until_ready(full(state, images, points, labels)),
  }, blocks=sizes["blocks"], per_block=sizes["per_block"])
  return {"side": side, "M": features.embeddings.shape[1], **{f"{k}_ms": 1e3 * v for k, v in seconds.items()},
          "full_over_decode": seconds["full"] / seconds["decode"]}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_output_flags(parser)
  args = parse_output_args(parser, "bench_segment", argv)
  sizes = QUICK if args.quick else FULL
  run = run_provenance()  # before measuring: the tree, the date and the load as the run starts
  load_before, started = run["load_average_before"], run["date"]
  rows = []
  for side in sizes["sides"]:
    rows.append(time_side(side, sizes))
    print(json.dumps(rows[-1]), flush=True)
  command = "python experiments/bench_segment.py" + (" --quick" if args.quick else "")
  import jax
  provenance = {"commit": commit_label(run, None), "date": started, "load_average_1min_before": load_before,
                "load_average_1min_after": os.getloadavg()[0], "command": command,
                "cores": len(os.sched_getaffinity(0)), "platform": platform.platform(), "jax": jax.__version__,
                "blocks": sizes["blocks"], "per_block": sizes["per_block"]}
  stem = os.path.join(args.out, "segment_benchmark")
  with open(stem + ".json", "w") as f:
    json.dump({"provenance": provenance, "rows": rows}, f, indent=1)
  table = ["| canvas | M features | encode ms | decode ms (per click) | full ms (re-encode per click) | full / decode |",
           "| --- | --- | --- | --- | --- | --- |"]
  table += [f"| {r['side']}x{r['side']} | {r['M']} | {r['encode_ms']:.2f} | {r['decode_ms']:.2f} | "
            f"{r['full_ms']:.2f} | {r['full_over_decode']:.1f}x |" for r in rows]
  text = ["# Segmenter: a click decoded from cached features vs the image re-encoded per click", "",
          f"{provenance_line({**run, 'command': command}, 12)} Machine: {provenance['cores']} CPU cores, "
          f"shared with other jobs (1-minute load average {provenance['load_average_1min_after']:.1f} after). Model: configs/segment_digits.py (ViT 3 blocks "
          f"width 64, 4x4 patches; 2 two-way blocks width 64; 3 masks), batch 1, one positive click, float32; "
          f"median of {sizes['blocks']} alternating blocks of {sizes['per_block']} back-to-back runs after warm-up, `block_until_ready` on every result.",
          "", *table, "",
          "`full / decode`: clicks answered from cached features (`Segmenter.decode`) in the time one click "
          "costs when the image is encoded again (`Segmenter.__call__`). The encoder's self-attention grows as "
          "M^2 and the decoder's cross-attention as M, so the ratio grows with the image."]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(text) + "\n")
  print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
  main()
