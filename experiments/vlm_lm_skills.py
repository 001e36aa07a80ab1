"""What the VLM's frozen LM can lend a connector: its answers from text alone, with and without the image's words.

    python experiments/vlm_lm_skills.py --lm workdirs/vlm_lm [--lm another_lm_run ...]

For the first --examples examples of --split (validation by default; test: those compare_connectors scores
at the defaults of configs/vlm_digits.py) of data.vlm_digits, the LM continues each text up to its last target, greedily, in two forms:
  marker only  the text as a connector's LM sees it ("<image> what is their sum ?"): the answers the LM
               can give without the image, the floor a connector starts from;
  described    each image's digits as words before its marker ("seven two <image> what is their sum ?"):
               the answers the LM gives when the image is read for it, which a connector can use by making
               the image read like its description.
Earlier targets stay in the prompt as references (the "larger" question follows both captions, so text alone
answers it in either form). A caption
has no question, so from text alone the LM cannot tell that one is asked: it may start a question instead.
Writes vlm_lm_skills.{md,json} (per LM run, its path and steps, exact match per kind and per digit count; commit,
date, load and command; and, described, each kind at each digit count) under --out (default experiments/results).
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from experiments import bench_common  # noqa: E402

FORMS = ("marker only", "described")


def prompts_and_answers(example, form: str) -> tuple[str, str]:
  """(the example's text in form up to its last target, that target)."""
  from xattn_jax.data import vlm_digits
  text = vlm_digits.described_text_of(example) if form == "described" else vlm_digits.text_of(example)
  answer = example.targets()[-1]
  if not text.endswith(f" {answer}"):
    raise ValueError(f"prompts_and_answers: the text {text!r} does not end with its last target {answer!r}")
  return text[:-len(answer) - 1], answer


def score(lm_workdir: str, examples, batch_size: int = 64, eval_from: str = "") -> dict:
  """form -> {"kind": {name: exact match}, "digits": {k: exact match}, "overall": exact match}, of the run's
  checkpoint named by eval_from (checkpoint.eval_from: latest, best or a kept step; "": the run's own)."""
  from xattn_jax.training import inference
  model, task = inference.load_model(lm_workdir, mode="infer",
                                     overrides={"checkpoint.eval_from": eval_from} if eval_from else None)
  result = {}
  for form in FORMS:
    pairs = [prompts_and_answers(e, form) for e in examples]
    outputs = []
    for start in range(0, len(pairs), batch_size):
      outputs += task.infer(model, [prompt for prompt, _ in pairs[start:start + batch_size]])
    hits = [output[len(prompt):].strip() == answer for (prompt, answer), output in zip(pairs, outputs)]
    by_kind, by_digits, by_both = (collections.defaultdict(list) for _ in range(3))
    for example, hit in zip(examples, hits):
      by_kind[example.kind].append(hit)
      by_digits[example.num_digits].append(hit)
      by_both[f"{example.kind}/{example.num_digits}"].append(hit)
    mean = lambda values: sum(values) / len(values)
    result[form] = {"overall": mean(hits), "kind": {k: mean(v) for k, v in sorted(by_kind.items())},
                    "digits": {str(k): mean(v) for k, v in sorted(by_digits.items())},
                    "kind_digits": {k: [sum(v), len(v)] for k, v in sorted(by_both.items())}}
  return result


def render(record: dict) -> str:
  prov, runs = record["provenance"], record["runs"]
  kinds = list(runs[0]["scores"][FORMS[0]]["kind"])
  digits = list(runs[0]["scores"][FORMS[0]]["digits"])
  lines = ["# What the VLM's frozen LM answers from text alone", "",
           bench_common.provenance_line(prov, 10), "",
           f"{record['examples']} \"{record.get('split', 'test')}\" examples of data.vlm_digits (seed {record['eval_seed']}, up to "
           f"{record['max_digits']} digits); greedy, the last target of each text, earlier targets given.", "",
           "| LM run | its data.describe_images | prompt | exact match | " + " | ".join(kinds) + " | "
           + " | ".join(f"k={d}" for d in digits) + " |",
           "| --- | --- | --- | --- | " + " | ".join("---" for _ in kinds + digits) + " |"]
  read = f", checkpoint {record['eval_from']}" if record.get("eval_from") else ""
  for run in runs:
    for form in FORMS:
      s = run["scores"][form]
      lines.append(f"| `{run['lm']}` ({run['lm_steps']} steps{read}) | {run['describe_images']} | {form} | "
                   f"{s['overall']:.3f} | " + " | ".join(f"{s['kind'][k]:.2f}" for k in kinds) + " | "
                   + " | ".join(f"{s['digits'][d]:.2f}" for d in digits) + " |")
  lines += ["", "Each kind at each digit count, image described (right / examples):", "",
            "| LM run | " + " | ".join(f"k={d}" for d in digits) + " |",
            "| --- | " + " | ".join("---" for _ in digits) + " |"]
  for run in runs:
    cells = run["scores"]["described"]["kind_digits"]
    for kind in kinds:
      lines.append(f"| `{run['lm']}` {kind} | " + " | ".join(
          "{} / {}".format(*cells[f"{kind}/{d}"]) if f"{kind}/{d}" in cells else "" for d in digits) + " |")
  lines += ["", "marker only: the text as a connector's LM sees it, no image; described: each image's digits as "
            "words before its marker. A caption has no question, so the LM may start one instead. The \"larger\" "
            "question follows both reference captions, so text alone answers it in either form."]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lm", action="append", help="a finished configs/vlm_lm.py run (repeatable; default "
                      "workdirs/vlm_lm)")
  parser.add_argument("--examples", type=int, default=256, help="examples (configs/vlm_digits.py's eval count)")
  parser.add_argument("--split", default="validation",
                      help="the bundled split the examples come from: validation (to choose an LM by) or test")
  parser.add_argument("--eval_seed", type=int, default=0)
  parser.add_argument("--eval_from", default="", help="the checkpoint of each LM to score (its "
                      "checkpoint.eval_from: latest, best or a kept step number; default: the run's own)")
  bench_common.add_output_flags(parser)
  args = bench_common.parse_output_args(parser, "vlm_lm_skills", argv)
  if args.quick:
    args.examples = min(args.examples, 16)
  args.lm = args.lm or ["workdirs/vlm_lm"]
  from xattn_jax.data import vlm_digits
  if args.split not in vlm_digits.EVAL_SPLITS:
    parser.error(f"--split: one of {vlm_digits.EVAL_SPLITS}, got {args.split!r}")
  for lm in args.lm:
    if not os.path.isfile(os.path.join(lm, "config.py")):
      parser.error(f"--lm {lm}: holds no finished run (train it: python launch.py --config=configs/vlm_lm.py "
                   f"--workdir={lm})")
  from xattn_jax.training import validation
  configs = [validation.load_config_file(os.path.join(lm, "config.py")) for lm in args.lm]
  max_digits = min(config.data.max_digits for config in configs)
  examples = vlm_digits.make_examples(args.split, args.examples, args.eval_seed, max_digits=max_digits)
  record = {"provenance": bench_common.provenance(argv), "examples": args.examples, "split": args.split,
            "eval_seed": args.eval_seed,
            "max_digits": max_digits,
            "eval_from": args.eval_from,
            "runs": [{"lm": os.path.abspath(lm), "lm_steps": config.total_steps,
                      "describe_images": bool(config.data.get("describe_images", False)),
                      "scores": score(lm, examples, eval_from=args.eval_from)} for lm, config in zip(args.lm, configs)]}
  print(render(record))
  bench_common.write_results(args.out, "vlm_lm_skills", record, render(record))


if __name__ == "__main__":
  main()
