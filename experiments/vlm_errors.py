"""Where trained VLM runs go wrong: exact match of every question kind at every digit count, and the wrong answers.

    python experiments/vlm_errors.py --workdir workdirs/compare_connectors/qformer_seed0 \
        --workdir workdirs/compare_connectors/llava_seed0

For each workdir (a finished configs/vlm_digits.py run) the latest checkpoint answers its eval set as its own eval
does (`VLMTask.eval_answers`, what `extra_eval` scores: greedy, earlier targets given as references), and each
target is counted under its kind and the digit count of its largest image, so a run's "2 digits" can be read as
which questions it misses there (the two-image "larger" questions are counted at their larger image). Writes vlm_errors.{md,json} under
--out (default experiments/results): the kind x digits table of every run, each cell "right / targets", and up
to --wrong wrong answers per run. --eval_examples N answers N bundled test examples instead of the run's eval
set (its first examples are the same), for cells large enough to compare.
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from experiments import bench_common  # noqa: E402


def answers(workdir: str, eval_examples: int = 0):
  """(connector, [(kind, digits, reference, answer)]) of the run's eval targets, in eval order; with
  eval_examples, that many bundled test examples instead of the run's data.num_eval_examples."""
  from xattn_jax.training import inference
  overrides = {"data.num_eval_examples": eval_examples} if eval_examples else None
  model, task = inference.load_model(workdir, mode="eval", overrides=overrides)
  return task.config.model.connector, task.eval_answers(model)


def table(rows) -> dict:
  """{kind: {digits: [right, targets]}} (keys as strings, for JSON)."""
  cells = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
  for kind, digits, reference, answer in rows:
    cells[kind][str(digits)][0] += answer == reference
    cells[kind][str(digits)][1] += 1
  return {kind: dict(sorted(by.items())) for kind, by in sorted(cells.items())}


def render(record: dict) -> str:
  prov = record["provenance"]
  lines = ["# Where the VLM runs go wrong (exact match by question kind and digit count)", "",
           bench_common.provenance_line(prov, 10), "",
           "Each cell: targets answered exactly / targets, counted at the digit count of the largest image "
           "(the two-image \"larger\" questions at their larger image).", ""]
  for run in record["runs"]:
    cells = run["table"]
    digits = sorted({d for by in cells.values() for d in by}, key=int)
    lines += [f"## `{run['workdir']}` ({run['connector']})", "",
              "| kind | " + " | ".join(f"k = {d}" for d in digits) + " | all |",
              "| --- | " + " | ".join("---" for _ in digits) + " | --- |"]
    for kind, by in cells.items():
      right, total = sum(c[0] for c in by.values()), sum(c[1] for c in by.values())
      lines.append(f"| {kind} | " + " | ".join(f"{by[d][0]} / {by[d][1]}" if d in by else "" for d in digits)
                   + f" | {right} / {total} ({right / total:.2f}) |")
    totals = [(sum(cells[k][d][0] for k in cells if d in cells[k]), sum(cells[k][d][1] for k in cells if d in cells[k]))
              for d in digits]
    lines.append("| all | " + " | ".join(f"{r} / {t} ({r / t:.2f})" for r, t in totals) + " | |")
    if run["wrong"]:
      lines += ["", "Wrong answers (kind, digits: reference -> answer):", ""]
      lines += [f"- {kind}, {digits}: \"{reference}\" -> \"{answer}\"" for kind, digits, reference, answer in run["wrong"]]
    lines.append("")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", action="append", required=True, help="a finished configs/vlm_digits.py run")
  parser.add_argument("--wrong", type=int, default=20, help="wrong answers listed per run")
  parser.add_argument("--eval_examples", type=int, default=0, help="bundled test examples to answer (0: the "
                      "run's data.num_eval_examples; its first N are the same examples)")
  bench_common.add_output_flags(parser)
  args = bench_common.parse_output_args(parser, "vlm_errors", argv)
  for workdir in args.workdir:
    if not os.path.isfile(os.path.join(workdir, "config.py")):
      parser.error(f"--workdir {workdir}: holds no finished VLM run")
  record = {"provenance": bench_common.provenance(argv), "runs": []}
  for workdir in args.workdir:
    connector, rows = answers(workdir, args.eval_examples)
    wrong = [row for row in rows if row[2] != row[3]]
    record["runs"].append({"workdir": os.path.abspath(workdir), "connector": connector, "table": table(rows),
                           "wrong": wrong[:args.wrong]})
  print(render(record))
  bench_common.write_results(args.out, "vlm_errors", record, render(record))


if __name__ == "__main__":
  main()
