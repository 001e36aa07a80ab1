"""Length generalization of the decoder-only model, measured as Kazemnejad et al. 2023 and Ruoss et al. 2023 do.

    python experiments/length_generalization.py --jobs=2 --seeds=3              # the full grid (~1.5 hours, 2 cores)
    python experiments/length_generalization.py --quick --results=/tmp/lg      # CI smoke test (two tiny cells)
    python experiments/length_generalization.py --only=copy,reverse --only=rope,alibi   # a part of the grid

Each cell = task x encoding x randomized positions or not x seed, one `launch.py` subprocess on
configs/lm_algorithmic.py (`input SEP output`, trained on inputs of 1-20 symbols); its result is
the final eval's exact match (and token accuracy) per input-length band 1-20, 21-40, 41-80.
  tasks       copy, reverse (both papers), sort (Kazemnejad et al.), duplicate (Ruoss et al.)
  encodings   every 1D encoding of the position registry (none = NoPE, learned, sinusoidal, rope, alibi,
              t5_bias, and any entry added to xattn_jax/layers/positions.py's POSITION_ENCODINGS)
  randomized  every encoding that reads positions and takes randomized ones (the registry's `randomizable`;
              not none) also trains with randomized positions (Ruoss et al.):
              `--config.model.randomized_positions_max=RANDOMIZED_MAX`.
              When configs/lm_algorithmic.py has no such field yet, those cells are skipped and
              the results say so.

Cell workdirs are `<workdir>/<task>/<encoding>[+randomized]/seed<k>`; a finished cell writes
result.json there and is never re-run; an interrupted one resumes from its last checkpoint
(launch.py's own resume). The tables count every finished cell of the grid on disk, every seed, so a
run with --only or fewer --seeds adds to the earlier ones (it says which); a cell finished under other
settings (another budget) is stale: reported, not counted, not trained over (experiments/sweep.py). Cells run
--jobs at a time, each on a single-threaded XLA.

Writes to --results: length_generalization.md (mean +- std of exact match per band over the seeds,
the papers' numbers beside ours), length_generalization.json and length_generalization.png; each
records the commit, date, load average before the start and the exact command.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))

from experiments import bench_common, sweep  # noqa: E402
from xattn_jax.layers import positions as position_layers  # noqa: E402

CONFIG = "configs/lm_algorithmic.py"
TASKS = ("copy", "reverse", "sort", "duplicate")
# Every 1D encoding of the registry: one registered there is a column here.
ENCODINGS = position_layers.names(layout="sequence")


def randomizable(encodings) -> tuple[str, ...]:
  """The encodings of `encodings` that take randomized positions (the registry's rule, which launch.py's validation
  applies) and read positions at all (NoPE has none to randomize)."""
  takes = set(position_layers.names(randomizable=True)) - set(position_layers.names(role="none"))
  return tuple(encoding for encoding in encodings if encoding in takes)


RANDOMIZED_ENCODINGS = randomizable(ENCODINGS)
# Positions are drawn from [0, RANDOMIZED_MAX): it covers the longest eval row of every task
# (duplicate at 80 symbols: BOS + 80 + SEP + 160 + EOS = 243 positions).
RANDOMIZED_MAX = 256
BANDS = ("1_20", "21_40", "41_80")
EXACT_MATCH = tuple(f"eval/exact_match_{band}" for band in BANDS)
TOKEN_ACCURACY = tuple(f"eval/token_accuracy_{band}" for band in BANDS)
METRICS = EXACT_MATCH + TOKEN_ACCURACY + ("eval/loss",)

# One model and step budget for the whole grid, fixed from the time of single cells and their training band
# (1-20) alone, never an extrapolation band. The largest that fits the 2 hours on an idle 2-core machine, two
# single-threaded cells at a time: `small` (4 layers, d_model 128) takes 175-223 s a cell at 800 steps (3.7 hours
# for the grid), `tiny` 67-125 s at 1,600 steps (about 1.8 hours); 800 steps, the budget before, left the training
# band unlearned in most cells (experiments/results/intel_xeon_amx/length_generalization_budget.md).
SIZE = "tiny"  # configs/lm_algorithmic.py SIZES: 2 layers, d_model 64, 4 heads, mlp 256
TOTAL_STEPS = 1600
OVERRIDES = {"total_steps": TOTAL_STEPS, "eval_every_steps": TOTAL_STEPS, "checkpoint.every_steps": TOTAL_STEPS,
             "log_every_steps": 100, "batch_size": 64, "optimizer.learning_rate": 1e-3,
             "optimizer.warmup_steps": 100, "task.num_eval_examples": 128,
             "logging.plot": False, "logging.tensorboard": False}
QUICK_SIZE = "micro"
QUICK_OVERRIDES = {"total_steps": 4, "eval_every_steps": 4, "checkpoint.every_steps": 4, "log_every_steps": 2,
                   "optimizer.warmup_steps": 2, "task.num_eval_examples": 4, "eval_batch_size": 4,
                   "steps_per_call": 4}
# --quick: one plain and one randomized cell, 1 seed: every code path of the runner, the plot included.
QUICK_CELLS = (("copy", "rope", False), ("copy", "rope", True))


@dataclasses.dataclass(frozen=True)
class Cell:
  task: str
  encoding: str
  randomized: bool
  seed: int

  @property
  def variant(self) -> str:
    """The row name: the encoding, `+randomized` when it trains on randomized positions."""
    return self.encoding + ("+randomized" if self.randomized else "")

  def workdir(self, root: pathlib.Path) -> pathlib.Path:
    return root / self.task / self.variant / f"seed{self.seed}"

  def command(self, root: pathlib.Path, quick: bool) -> list[str]:
    size = QUICK_SIZE if quick else SIZE
    overrides = {**OVERRIDES, **(QUICK_OVERRIDES if quick else {}), "seed": self.seed}
    if self.randomized:
      overrides["model.randomized_positions_max"] = RANDOMIZED_MAX
    return [sys.executable, str(REPOSITORY / "launch.py"),
            f"--config={REPOSITORY / CONFIG}:operation={self.task},posenc={self.encoding},size={size}",
            f"--workdir={self.workdir(root)}", *(f"--config.{k}={v}" for k, v in overrides.items())]


def variants() -> list[tuple[str, bool]]:
  """(encoding, randomized) in table order: each encoding, then its randomized twin."""
  return [(encoding, randomized) for encoding in ENCODINGS for randomized in (False, True)
          if not randomized or encoding in RANDOMIZED_ENCODINGS]


def cells(quick: bool, seeds: int, only: set[str] = frozenset(), randomized: bool = True) -> list[Cell]:
  """The grid's cells (seed-major, so a partial run covers every variant once before repeating).

  only: task and encoding names; a cell is kept when its task is among the tasks named (or none is)
  and its encoding among the encodings named (or none is). randomized=False drops the randomized cells.
  """
  unknown = set(only) - set(TASKS) - set(ENCODINGS)
  if unknown:
    raise ValueError(f"cells: only has unknown names {sorted(unknown)}; allowed: tasks {list(TASKS)}, "
                     f"encodings {list(ENCODINGS)}")
  if seeds < 1:
    raise ValueError(f"cells: seeds must be >= 1, got {seeds}")
  tasks = [t for t in TASKS if t in only] or list(TASKS)
  encodings = [e for e in ENCODINGS if e in only] or list(ENCODINGS)
  grid = QUICK_CELLS if quick else [(t, e, r) for t in TASKS for e, r in variants()]
  return [Cell(t, e, r, seed) for seed in range(seeds) for t, e, r in grid
          if t in tasks and e in encodings and (randomized or not r)]


def randomized_supported() -> bool:
  """Whether configs/lm_algorithmic.py has model.randomized_positions_max (read now, not at import)."""
  from configs import lm_algorithmic
  return "randomized_positions_max" in lm_algorithmic.get_config("operation=copy,posenc=rope").model


def run_cell(cell: Cell, root: pathlib.Path, quick: bool, single_thread: bool) -> tuple[Cell, dict | None, str]:
  """Trains one cell unless its result.json exists (experiments/sweep.py); returns (cell, metrics or None, message)."""
  return sweep.run_cell(cell, root, quick, METRICS, single_thread)


def summarize(results: dict[tuple[str, str], list[dict]]) -> dict:
  """{task: {variant: {metric: {"mean", "std", "seeds"}}}} in table order; std is the sample std (0 for 1 seed)."""
  summary = {}
  for task in TASKS:
    for encoding, randomized in variants():
      variant = encoding + ("+randomized" if randomized else "")
      runs = results.get((task, variant), [])
      if runs:
        summary.setdefault(task, {})[variant] = sweep.mean_std(runs, METRICS)
  return summary


def budget_line(quick: bool = False) -> str:
  """The model and step budget every cell of the grid shares, in words."""
  from configs import lm_algorithmic
  size = QUICK_SIZE if quick else SIZE
  d_model, num_heads, num_layers, mlp_dim = lm_algorithmic.SIZES[size]
  overrides = {**OVERRIDES, **(QUICK_OVERRIDES if quick else {})}
  layers = f"{num_layers} layer" + ("s" if num_layers > 1 else "")
  return (f"Budget (every cell): `{CONFIG}` size `{size}` ({layers}, d_model {d_model}, {num_heads} heads, "
          f"MLP {mlp_dim}), {overrides['total_steps']} steps of batch {overrides['batch_size']} (inputs of 1-20 "
          f"symbols, fresh samples each step, 16 symbols), AdamW lr {overrides['optimizer.learning_rate']} with "
          f"{overrides['optimizer.warmup_steps']} warmup steps then cosine decay, "
          f"{overrides['task.num_eval_examples']} eval strings per band; randomized positions drawn from "
          f"[0, {RANDOMIZED_MAX}) in training, 0..n-1 at eval.")


def markdown(summary: dict, meta: dict, notes: list[str], quick: bool = False) -> str:
  """The results file: provenance, budget, one table per task (exact match per band), notes, the papers."""
  lines = ["# Length generalization of the decoder-only model"
           + (" (--quick smoke run: numbers mean nothing)" if quick else ""), "",
           *sweep.provenance_lines(meta), "", budget_line(quick), "",
           "Exact match (whole output and EOS right, teacher-forced = greedy) per input-length band, mean ± "
           "sample std over seeds (n = every seed of the cell that finished on disk, whatever --seeds and --only the "
           "last run asked for); trained on 1-20, so 21-40 and 41-80 are extrapolation. "
           "Generated by `experiments/length_generalization.py`.", ""]
  for task in TASKS:
    if task not in summary:
      continue
    lines += [f"## {task}", "", "| encoding | randomized | " + " | ".join(b.replace("_", "-") for b in BANDS)
              + " | n |", "| --- | --- |" + " --- |" * (len(BANDS) + 1)]
    for variant, metrics in summary[task].items():
      encoding, randomized = variant.split("+")[0], "+" in variant
      cells_text = [f"{metrics[k]['mean']:.3f} ± {metrics[k]['std']:.3f}" if k in metrics else "-"
                    for k in EXACT_MATCH]
      seeds = next(iter(metrics.values()))["seeds"]
      lines.append(f"| {encoding} | {'yes' if randomized else 'no'} | " + " | ".join(cells_text) + f" | {seeds} |")
    lines.append("")
  return "\n".join(lines + notes + [""] + PAPERS) + "\n"


def plot(summary: dict, meta: dict, path: pathlib.Path, quick: bool = False):
  """Exact match against length band, a panel per task, a line per variant (dashed = randomized)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  tasks = [t for t in TASKS if t in summary]
  figure, axes = plt.subplots(1, max(len(tasks), 1), figsize=(max(4.2 * len(tasks), 8), 4.2), squeeze=False)
  colors = dict(zip(ENCODINGS, plt.get_cmap("tab10").colors))
  for axis, task in zip(axes[0], tasks):
    for variant, metrics in summary[task].items():
      encoding = variant.split("+")[0]
      means = [metrics[k]["mean"] if k in metrics else float("nan") for k in EXACT_MATCH]
      stds = [metrics[k]["std"] if k in metrics else 0.0 for k in EXACT_MATCH]
      axis.errorbar(range(len(BANDS)), means, yerr=stds, capsize=2, marker="o", color=colors[encoding],
                    linestyle="--" if "+" in variant else "-", label=variant)
    axis.set_xticks(range(len(BANDS)), [b.replace("_", "-") for b in BANDS])
    axis.set(title=task, xlabel="input length (trained on 1-20)", ylabel="exact match", ylim=(-0.03, 1.03))
  if tasks:
    axes[0][0].legend(fontsize=7, ncol=2)
  figure.suptitle("Decoder-only length generalization" + (" (--quick: numbers mean nothing)" if quick else ""))
  figure.text(0.01, 0.005, f"commit {meta['commit']}, {meta['date']}, load average {meta['load_average']}\n"
              f"{meta['command']}", fontsize=5, wrap=True)
  figure.tight_layout(rect=(0, 0.05, 1, 1))
  figure.savefig(path, dpi=110, metadata={"Description": json.dumps(meta)})
  plt.close(figure)


def write_outputs(summary: dict, meta: dict, out: pathlib.Path, notes: list[str], quick: bool = False):
  out.mkdir(parents=True, exist_ok=True)
  document = {"meta": meta, "budget": budget_line(quick), "overrides": {**OVERRIDES, **(QUICK_OVERRIDES if quick
                                                                                          else {})},
              "notes": notes, "summary": summary}
  (out / "length_generalization.json").write_text(json.dumps(document, indent=1) + "\n")
  (out / "length_generalization.md").write_text(markdown(summary, meta, notes, quick))
  plot(summary, meta, out / "length_generalization.png", quick)


def run_metadata(argv: list[str]) -> dict:
  return sweep.run_metadata(__file__, argv)


NOTES = [
    "Notes:",
    "- Exact match is read from the teacher-forced pass: every output position right given the gold prefix is "
    "the same event as greedy decoding returning the output (`xattn_jax/tasks/lm/algorithmic.py`).",
    "- `learned` has a row per position of the longest eval row, but training (inputs of 1-20) reaches only the "
    "first rows; the others keep their initialisation unless positions are randomized.",
    "- Randomized positions: each training row gets sorted distinct positions drawn from [0, "
    f"{RANDOMIZED_MAX}); evaluation uses 0..n-1 (Ruoss et al.'s published code draws them at evaluation too).",
]

# The papers' numbers beside ours: only what was read in the papers or their published repositories.
PAPERS = [
    "## The papers' numbers",
    "",
    "**Kazemnejad et al. 2023** (\"The Impact of Positional Encoding on Length Generalization in Transformers\", "
    "repository McGill-NLP/length-generalization). Numbers from the repository's exported run summaries "
    "`results/sanity_check.jsonl` (runs with `job_type` = `best_run_seed_exp`, 3 seeds: 146317, 234054, 256788), "
    "not read off a figure, and we could not tell which figure of the paper they feed. "
    "`sum__pred/valid_acc_overall` is exact match of the decoded answer on held-out strings of the training "
    "lengths 1-20; `sum__pred/test_acc_overall` is exact match on lengths 21-40 (10,000 strings). "
    "Mean ± sample std over the 3 seeds (our computation from the per-seed values in the file):",
    "",
    "| task (split in the file) | band | NoPE | APE (sinusoidal) | RoPE | ALiBi | T5 bias |",
    "| --- | --- | --- | --- | --- | --- | --- |",
    "| copy (`s2s_copy` `cmc_tr20_ts40`) | 1-20 | 0.894 ± 0.002 | 0.898 ± 0.001 | 0.899 ± 0.001 | 0.899 ± 0.001 "
    "| 0.898 ± 0.001 |",
    "| copy | 21-40 | 0.305 ± 0.023 | 0.028 ± 0.005 | 0.011 ± 0.007 | 0.331 ± 0.012 | 0.420 ± 0.014 |",
    "| reverse (`s2s_reverse` `mc_tr20_ts40`) | 1-20 | 0.999 ± 0.000 | 1.000 ± 0.000 | 1.000 ± 0.000 "
    "| 1.000 ± 0.000 | 0.999 ± 0.000 |",
    "| reverse | 21-40 | 0.230 ± 0.010 | 0.023 ± 0.012 | 0.077 ± 0.075 | 0.171 ± 0.011 | 0.242 ± 0.023 |",
    "| duplicate (`s2s_copy` `cmc2x_tr20_ts40`: s [NEXT] s) | 1-20 | 0.992 ± 0.001 | 0.998 ± 0.001 "
    "| 1.000 ± 0.000 | 1.000 ± 0.000 | 0.998 ± 0.001 |",
    "| duplicate | 21-40 | 0.431 ± 0.009 | 0.040 ± 0.003 | 0.043 ± 0.005 | 0.569 ± 0.021 | 0.524 ± 0.023 |",
    "",
    "- sort: none of the result files we could read holds sort runs (`results/scratchpad_f.jsonl`, listed in "
    "the repository, is not in the stored snapshot), so no sort numbers are quoted. The file has no learned "
    "absolute and no randomized-position runs. The copy 1-20 score (~0.90 for every encoding) is as logged.",
    "- Their setup (from the same file and `scripts/dataset_builders/`): a decoder-only T5-base-sized model "
    "(`sum__num_trainable_params` = 109,607,040), 40,000 steps of batch 64, lr 3e-5 with polynomial decay, "
    "weight decay 0.05, a fixed set of 100,000 training strings (~25.6 epochs), an alphabet of 100 tokens, "
    "greedy decoding; lengths 21-40 only (no 41-80 band).",
    "",
    "**Ruoss et al. 2023** (\"Randomized Positional Encodings Boost Length Generalization of Transformers\", "
    "repository google-deepmind/randomized_positional_encodings). Read in the paper (abstract, "
    "ar5iv.labs.arxiv.org/html/2305.16843): 6000 models on 15 algorithmic tasks; randomized positional "
    "encodings increase test accuracy by 12.0% on average. Its per-task table could not be read with the "
    "tools at hand and the repository publishes code only (no result files), so no per-task numbers are "
    "quoted here.",
    "- Their setup (from the repository, `experiments/example.py`, `experiments/constants.py`, "
    "`models/positional_encodings.py`): an encoder-only Transformer (`transformer_encoder`, 5 layers, "
    "embedding 64, dropout 0.1) that emits the output in one pass (not autoregressive by default), "
    "10,000 steps of batch 128, lr 1e-3, training lengths 1-40, score = mean over test lengths beyond 40 of "
    "per-token accuracy (not exact match); reverse_string and duplicate_string over a binary alphabet, "
    "bucket_sort over 5 symbols; randomized positions drawn from [0, 2048) in the example, also at evaluation.",
    "",
    "Where our setup differs from both: a decoder-only model of ~0.1M parameters and the step budget above "
    "(orders of magnitude smaller and shorter than either paper's), fresh random strings every step, 16 symbols, "
    "exact match per band of input lengths, and a 41-80 band beyond Kazemnejad et al.'s test range.",
]


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--jobs", type=int, default=2, help="cells trained at the same time")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="two micro cells, a few steps, 1 seed")
  parser.add_argument("--only", action="append", default=[],
                      help="comma-separated task and / or encoding names to run (default: the whole grid)")
  parser.add_argument("--workdir", default=str(REPOSITORY / "workdirs" / "length_generalization"))
  parser.add_argument("--results", default=None,
                      help="where the table, JSON and plot go; default experiments/results, or a temporary "
                           "directory with --quick (a smoke run must not overwrite the recorded results)")
  args = parser.parse_args(argv)
  sweep.check_jobs(args.jobs, parser)
  sweep.check_seeds(args.seeds, args.seeds, parser)
  only = {name for group in args.only for name in group.split(",") if name}
  unknown = only - set(TASKS) - set(ENCODINGS)
  if unknown:
    parser.error(f"--only: unknown names {sorted(unknown)}; allowed: tasks {list(TASKS)}, encodings {list(ENCODINGS)}")
  if args.results is None:
    args.results = (tempfile.mkdtemp(prefix="length_generalization_quick_") if args.quick
                    else str(REPOSITORY / "experiments" / "results"))
  meta = run_metadata(argv)
  seeds = sweep.seeds_to_run(args, parser)
  randomized = randomized_supported()
  notes = list(NOTES)
  if not randomized:
    skipped = len(cells(args.quick, seeds, only)) - len(cells(args.quick, seeds, only, randomized=False))
    message = (f"randomized cells skipped ({skipped}): {CONFIG} has no model.randomized_positions_max yet, "
               "so --config.model.randomized_positions_max cannot be passed")
    print(message, flush=True)
    notes.append(f"- **{message}.**")
  sweep.check_folders(args, parser)
  root = pathlib.Path(args.workdir) / ("quick" if args.quick else "full")
  todo = cells(args.quick, seeds, only, randomized)
  if not todo:  # an empty table and plot read as a result
    parser.error(f"--only={','.join(sorted(only))} selects none of the {'--quick ' if args.quick else ''}cells "
                 f"({', '.join(sorted({f'{c.task}/{c.encoding}' for c in cells(args.quick, 1)}))})")
  failures, start = 0, time.time()

  def report(cell, metrics, message):
    nonlocal failures
    print(f"[{time.time() - start:6.0f}s] {cell.task}/{cell.variant}/seed{cell.seed}: {message}", flush=True)
    failures += metrics is None

  sweep.run_cells(todo, lambda cell: run_cell(cell, root, args.quick, args.jobs > 1), args.jobs, report)
  # The tables count every finished cell on disk: an --only run adds to the others, fewer --seeds hide none.
  rows = cells(args.quick, 1, randomized=randomized)
  finished = sweep.finished_cells(rows, root, args.quick)
  from_disk = sweep.taken_from_disk(finished, todo, root, lambda cell: cell.task, rows)
  if from_disk:
    print(from_disk, flush=True)
    notes.append(f"- Run note: {from_disk}.")
  summary = summarize(sweep.grouped(finished, lambda cell: (cell.task, cell.variant)))
  write_outputs(summary, meta, pathlib.Path(args.results), notes, args.quick)
  print(f"wrote {args.results}/length_generalization.md ({len(todo) - failures}/{len(todo)} cells this run)")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
