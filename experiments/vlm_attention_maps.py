"""Attention maps of trained VLM runs: where Q-Former queries and Flamingo's text tokens look in the image.

    python experiments/vlm_attention_maps.py --workdir workdirs/compare_connectors/qformer_seed0 \
        --workdir workdirs/compare_connectors/flamingo_seed0

For each workdir (a finished configs/vlm_digits.py run of the qformer or flamingo connector; llava has no
cross-attention) the latest checkpoint answers the first question of --examples test images, one per
digit count 1, 2, ... (caption questions first), and `xattn_jax.tasks.vlm.plots.attention_figure` draws
the image, the prompt and the generated answer, then the maps: per query (qformer) or per generated token
(flamingo). Writes experiments/results/vlm_attention_<connector>.png and vlm_attention_maps.md (the run's
commit, date, load and command, and each example's answer against its reference), or under --out DIR.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def pick_examples(examples, count: int):
  """Up to count one-image examples with 1, 2, ... digits (cycling), caption questions preferred."""
  single = [e for e in examples if len(e.images) == 1]
  single.sort(key=lambda e: e.kind != "caption")  # stable: the captions first, then the rest as they come
  chosen, sizes = [], sorted({e.num_digits for e in single})
  for k in range(count):
    size = sizes[k % len(sizes)] if sizes else None
    pick = next((e for e in single if e.num_digits == size and not any(e is c for c in chosen)), None)
    if pick is not None:
      chosen.append(pick)
  return chosen


def draw(workdir: str, out_dir: str, examples: int) -> tuple[str, list[str]]:
  """Draws one workdir's maps -> (the PNG's path, a markdown line per example)."""
  from xattn_jax.tasks.vlm import plots
  from xattn_jax.training import inference
  model, task = inference.load_model(workdir, mode="eval")
  path = os.path.join(out_dir, f"vlm_attention_{task.config.model.connector}.png")
  chosen = pick_examples(task.eval_examples, examples)
  drawn = plots.attention_figure(task, model, chosen, path)
  lines = [f"- {example.num_digits} digit(s), {prompt.strip() or '(caption)'}: generated \"{answer}\", reference "
           f"\"{example.targets()[0]}\"" for example, (_, prompt, answer, _) in zip(chosen, drawn)]
  return path, lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", action="append", required=True, help="a trained qformer or flamingo run")
  parser.add_argument("--examples", type=int, default=3)
  parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  from experiments import bench_common
  record = bench_common.provenance(argv)
  text = ["# Where the connectors look (attention maps of trained runs)", "",
          bench_common.provenance_line(record, 10), ""]
  for workdir in args.workdir:
    path, lines = draw(workdir, args.out, args.examples)
    print(path)
    text += [f"## {os.path.basename(path)} (run {workdir})", "", *lines, ""]
  with open(os.path.join(args.out, "vlm_attention_maps.md"), "w") as f:
    f.write("\n".join(text))


if __name__ == "__main__":
  main()
