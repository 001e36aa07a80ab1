"""Position-encoding ablation: every encoding on three tasks, several seeds, one command.

    python experiments/ablate_positions.py --jobs=2 --seeds=3          # the real sweep (~1 hour, 2 cores)
    python experiments/ablate_positions.py --quick --results=/tmp/r    # CI smoke test (a few cells)

Experiments (each cell = experiment x encoding x seed, one `launch.py` subprocess):
  dates       the translator on bundled English -> French dates: exact match and chrF (greedy);
  length      the translator copying strings of 1-32 symbols, exact match on 1-32, 33-64, 65-128;
  resolution  the Perceiver on 8x8 digits, accuracy on the 8x8 test images and resized to 12x12, 16x16.

Each cell trains in its own workdir `<workdir>/<experiment>/<encoding>/seed<k>`; when it ends, its
final eval metrics go to `result.json` there. A cell with a result.json is never re-run (one trained
under other settings is stale: reported and not counted, experiments/sweep.py). The tables count every
finished cell on disk, so a run with --only or fewer --seeds adds to the earlier ones (it says which); an
interrupted one resumes from its last checkpoint (launch.py's own resume). Cells run `--jobs` at a
time, each with a single-threaded XLA so that parallel jobs do not fight over the cores.

Writes to --results: ablation_positions.md / .json (mean +- std over seeds per cell, seed count)
and the PNGs ablation_length_bands.png, ablation_resolution.png, ablation_dot_products.png,
ablation_rope_scores.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY))

from experiments import sweep  # noqa: E402
from xattn_jax.models import latent_reader, translator  # noqa: E402

# What each model accepts, as the position registry (xattn_jax.layers.positions) lists it at import: the cells'
# launch.py runs register nothing more.
SEQUENCE_ENCODINGS = translator.position_encodings()
IMAGE_ENCODINGS = latent_reader.grid_encodings()


@dataclasses.dataclass(frozen=True)
class Experiment:
  name: str
  config: str                      # config file and argument, "{encoding}" filled in per cell
  encodings: tuple[str, ...]
  metrics: tuple[tuple[str, str], ...]  # (key in metrics.jsonl, column title)
  overrides: dict                  # --config.KEY=VALUE for the real sweep
  quick_overrides: dict            # ... and on top of them for --quick


_MICRO_TRANSLATOR = {f"model.{side}.{key}": value for side in ("encoder", "decoder")
                     for key, value in (("d_model", 32), ("num_heads", 2), ("num_layers", 1), ("mlp_dim", 64))}
_QUICK = {"total_steps": 6, "eval_every_steps": 6, "checkpoint.every_steps": 6, "log_every_steps": 3,
          "logging.plot": False, "logging.tensorboard": False}

EXPERIMENTS = (
    Experiment(
        "dates", "configs/translate_dates.py:posenc={encoding}", SEQUENCE_ENCODINGS,
        (("eval/exact_match", "exact match"), ("eval/chrf", "chrF"), ("eval/loss", "eval loss (unsmoothed)")),
        # the last step's score on the test dates (one eval, at the end: nothing is chosen on it)
        {"total_steps": 200, "eval_every_steps": 200, "checkpoint.every_steps": 200, "task.num_attention_plots": 0,
         "task.num_decode_examples": 200, "task.num_samples_logged": 0, "data.eval_split": "test",
         **{f"model.{side}.{key}": value for side in ("encoder", "decoder")
            for key, value in (("d_model", 64), ("mlp_dim", 256))}},
        {**_QUICK, **_MICRO_TRANSLATOR, "data.tokenizer": "bytes", "data.first_year": 2000, "data.last_year": 2001,
         "eval_batch_size": 32, "task.num_decode_examples": 8}),
    Experiment(
        "length", "configs/algorithmic.py:posenc={encoding},operation=copy", SEQUENCE_ENCODINGS,
        tuple((f"eval/{metric}_{band}", f"{title} {band.replace('_', '-')}") for metric, title in
              (("exact_match", "exact match"), ("token_accuracy", "token acc.")) for band in ("1_32", "33_64", "65_128")),
        {"total_steps": 2000, "eval_every_steps": 2000, "checkpoint.every_steps": 1000,
         "task.num_eval_examples": 64},
        {**_QUICK, "model.d_model": 32, "model.num_heads": 2, "model.num_layers": 1, "model.mlp_dim": 64,
         "task.num_eval_examples": 8, "eval_batch_size": 8}),
    Experiment(
        "resolution", "configs/perceiver_digits.py:posenc={encoding}", IMAGE_ENCODINGS,
        (("eval/accuracy", "8x8 (trained)"), ("eval/accuracy_12x12", "12x12"), ("eval/accuracy_16x16", "16x16")),
        # the last step's accuracy on the test images (one eval, at the end: nothing is chosen on it)
        {"total_steps": 1000, "eval_every_steps": 1000, "checkpoint.every_steps": 1000,
         "task.num_attention_images": 0, "data.eval_split": "test"},
        {**_QUICK, "model.d_model": 32, "model.num_latents": 8, "model.num_blocks": 1}),
)
# --quick runs one cell per experiment, 1 seed: every code path of the runner, the plots included.
QUICK_CELLS = {"dates": ("rope",), "length": ("learned",), "resolution": ("learned_2d",)}


@dataclasses.dataclass(frozen=True)
class Cell:
  experiment: Experiment
  encoding: str
  seed: int

  def workdir(self, root: pathlib.Path) -> pathlib.Path:
    return root / self.experiment.name / self.encoding / f"seed{self.seed}"

  def command(self, root: pathlib.Path, quick: bool) -> list[str]:
    overrides = {**self.experiment.overrides, **(self.experiment.quick_overrides if quick else {}),
                 "seed": self.seed}
    return [sys.executable, str(REPOSITORY / "launch.py"),
            f"--config={REPOSITORY / self.experiment.config.format(encoding=self.encoding)}",
            f"--workdir={self.workdir(root)}", *(f"--config.{k}={v}" for k, v in overrides.items())]


def cells(quick: bool, seeds: int, only: set[str]) -> list[Cell]:
  result = []
  for experiment in EXPERIMENTS:
    if only and experiment.name not in only:
      continue
    encodings = QUICK_CELLS[experiment.name] if quick else experiment.encodings
    result += [Cell(experiment, encoding, seed) for seed in range(seeds) for encoding in encodings]
  return result


def run_cell(cell: Cell, root: pathlib.Path, quick: bool, single_thread: bool) -> tuple[Cell, dict | None, str]:
  """Trains one cell unless its result.json exists (experiments/sweep.py); returns (cell, metrics or None, message)."""
  return sweep.run_cell(cell, root, quick, [key for key, _ in cell.experiment.metrics], single_thread)


def summarize(results: dict[tuple[str, str], list[dict]]) -> dict:
  """{experiment: {encoding: {metric: {"mean", "std", "seeds"}}}} over the seeds that finished."""
  summary = {}
  for experiment in EXPERIMENTS:
    for encoding in experiment.encodings:
      runs = results.get((experiment.name, encoding), [])
      if not runs:
        continue
      summary.setdefault(experiment.name, {})[encoding] = sweep.mean_std(runs, [key for key, _ in experiment.metrics])
  return summary


def markdown(summary: dict, notes: list[str], quick: bool = False, meta: dict | None = None) -> str:
  lines = ["# Position-encoding ablation" + (" (--quick smoke run: numbers mean nothing)" if quick else ""), "",
           "Mean ± standard deviation over seeds (n = every seed of the cell that finished on disk, whatever "
           "--seeds and --only the last run asked for); generated by "
           "`experiments/ablate_positions.py`.", "", *(sweep.provenance_lines(meta) + [""] if meta else [])]
  for experiment in EXPERIMENTS:
    if experiment.name not in summary:
      continue
    titles = [title for _, title in experiment.metrics]
    lines += [f"## {experiment.name}", "", "| encoding | " + " | ".join(titles) + " | n |",
              "| --- |" + " --- |" * (len(titles) + 1)]
    for encoding, metrics in summary[experiment.name].items():
      cells_text = [f"{m['mean']:.3f} ± {m['std']:.3f}" for m in (metrics[key] for key, _ in experiment.metrics)]
      seeds = next(iter(metrics.values()))["seeds"]
      lines.append(f"| {encoding} | " + " | ".join(cells_text) + f" | {seeds} |")
    overrides = {**experiment.overrides, **(experiment.quick_overrides if quick else {})}
    lines += ["", f"Each cell: `launch.py --config={experiment.config}` with "
              + ", ".join(f"`{k}={v}`" for k, v in overrides.items()) + ".", ""]
  return "\n".join(lines + notes) + "\n"


def plot_bars(summary_rows: dict, panels, path: pathlib.Path, title: str):
  """Grouped bars, one panel per (ylabel, metrics): a group per metric (length band / resolution), a bar
  per encoding, the std over seeds as error bar."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  encodings = list(summary_rows)
  width = 0.8 / max(len(encodings), 1)
  figure, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 3.8), squeeze=False)
  for axis, (ylabel, metrics) in zip(axes[0], panels):
    for i, encoding in enumerate(encodings):
      means = [summary_rows[encoding][key]["mean"] for key, _ in metrics]
      stds = [summary_rows[encoding][key]["std"] for key, _ in metrics]
      axis.bar(np.arange(len(metrics)) + i * width, means, width, yerr=stds, capsize=2, label=encoding)
    axis.set_xticks(np.arange(len(metrics)) + width * (len(encodings) - 1) / 2, [t for _, t in metrics])
    axis.set(ylim=(0, 1.05), ylabel=ylabel)
    axis.legend(fontsize=8, ncol=3)
  figure.suptitle(title)
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def learned_table(workdir: pathlib.Path):
  """The trained target-side position table of a finished "learned" length cell, or None."""
  import orbax.checkpoint as ocp
  from xattn_jax.training import checkpoints
  steps = checkpoints.step_numbers(str(workdir))  # a save cut short (`6.orbax-checkpoint-tmp-...`) is no step
  if not steps:
    return None
  with ocp.StandardCheckpointer() as checkpointer:
    model = checkpointer.restore(workdir / "checkpoints" / str(steps[-1]) / "model")
  return model["target_positions"]["table"]


def write_outputs(results, root: pathlib.Path, out: pathlib.Path, notes: list[str], quick: bool = False,
                  meta: dict | None = None):
  import plot_encodings  # experiments/ is on sys.path when this file runs as a script
  out.mkdir(parents=True, exist_ok=True)
  summary = summarize(results)
  (out / "ablation_positions.json").write_text(json.dumps({**summary, "provenance": meta}, indent=1) + "\n")
  (out / "ablation_positions.md").write_text(markdown(summary, notes, quick, meta))
  by_name = {e.name: e for e in EXPERIMENTS}
  length, resolution = by_name["length"].metrics, by_name["resolution"].metrics
  for name, filename, title, panels in (
      ("length", "ablation_length_bands.png", "Copying strings, trained on lengths 1-32: by length band",
       [("exact match", length[:3]), ("token accuracy", length[3:])]),
      ("resolution", "ablation_resolution.png", "Perceiver on digits, trained on 8x8: by input resolution",
       [("accuracy", resolution)])):
    if name in summary:
      plot_bars(summary[name], panels, out / filename, title)
  learned = Cell(by_name["length"], "learned", 0)  # a stale cell's table is another run's, as its row is
  table = learned_table(learned.workdir(root)) if sweep.finished_result(learned, root, quick) else None
  plot_encodings.plot_dot_products(str(out / "ablation_dot_products.png"), learned=table,
                                   learned_note="(length task; rows >= 33 untrained)")
  plot_encodings.plot_rope_scores(str(out / "ablation_rope_scores.png"))


NOTES = [
    "Notes:",
    "- `learned` on the length task: the table has a row for every eval position (129 rows), but training "
    "only reaches rows 0-32 (strings of up to 32 symbols plus EOS); rows 33-128 keep their random "
    "initialisation (std 0.02), so the 33-64 and 65-128 columns measure a model reading untrained rows.",
    "- Length-task exact match is read from the teacher-forced pass, which equals greedy decoding's exact match "
    "(see `xattn_jax/tasks/algorithmic.py`).",
    "- `alibi` and `t5_bias` bias the self-attention of the encoder (symmetric / bidirectional) and the decoder "
    "(causal / unidirectional); cross-attention has no position bias (nor rotary, for `rope`). Copying needs "
    "the decoder's i-th query to find the i-th source token through cross-attention, so the encoder must "
    "write absolute positions into its outputs: additive encodings give them, RoPE lets the encoder recover "
    "them, `none` cannot (a permutation-equivariant encoder), and ALiBi / T5 biases do not in this budget.",
    "- `learned_2d` on 12x12 and 16x16 reads its 8x8 table resized bilinearly; `fourier` encodes coordinates "
    "normalized to [-1, 1], so a finer grid samples the same range; `sincos_2d` and `rope_2d` encode integer "
    "row / column indices, so on 12x12 and 16x16 most positions lie outside the 0-7 seen in training "
    "(extrapolation, not interpolation).",
]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--jobs", type=int, default=2, help="cells trained at the same time")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="tiny models, a few steps, 1 seed, a subset of cells")
  parser.add_argument("--only", action="append", default=[],
                      help="comma-separated experiments to run, the flag repeatable (default: all)")
  parser.add_argument("--workdir", default=str(REPOSITORY / "workdirs" / "ablation"))
  parser.add_argument("--results", default=None,
                      help="where the tables and plots go; default experiments/results, or a temporary "
                           "directory with --quick (a smoke run must not overwrite the recorded results)")
  args = parser.parse_args(argv)
  sweep.check_jobs(args.jobs, parser)
  sweep.check_seeds(args.seeds, args.seeds, parser)
  meta = sweep.run_metadata(__file__, argv if argv is not None else sys.argv[1:])  # before any cell: its load
  # each --only adds, as length_generalization.py's
  only = {name for group in args.only for name in group.split(",") if name}
  unknown = only - {e.name for e in EXPERIMENTS}
  if unknown:
    parser.error(f"--only: unknown experiments {sorted(unknown)}; allowed: {[e.name for e in EXPERIMENTS]}")
  if args.results is None:
    args.results = (tempfile.mkdtemp(prefix="ablation_quick_") if args.quick
                    else str(REPOSITORY / "experiments" / "results"))
  sweep.check_folders(args, parser)
  root = pathlib.Path(args.workdir) / ("quick" if args.quick else "full")
  todo = cells(args.quick, sweep.seeds_to_run(args, parser), only)
  failures, start = 0, time.time()

  def report(cell, metrics, message):
    nonlocal failures
    print(f"[{time.time() - start:6.0f}s] {cell.experiment.name}/{cell.encoding}/seed{cell.seed}: {message}",
          flush=True)
    failures += metrics is None

  sweep.run_cells(todo, lambda cell: run_cell(cell, root, args.quick, args.jobs > 1), args.jobs, report)
  # The tables count every finished cell on disk: an --only run adds to the others, fewer --seeds hide none.
  rows = cells(args.quick, 1, set())
  finished = sweep.finished_cells(rows, root, args.quick)
  from_disk = sweep.taken_from_disk(finished, todo, root, lambda cell: cell.experiment.name, rows)
  if from_disk:
    print(from_disk, flush=True)
  notes = NOTES + ([f"- Run note: {from_disk}."] if from_disk else [])
  results = sweep.grouped(finished, lambda cell: (cell.experiment.name, cell.encoding))
  write_outputs(results, root, pathlib.Path(args.results), notes, args.quick, meta)
  print(f"wrote {args.results}/ablation_positions.md ({len(todo) - failures}/{len(todo)} cells this run)")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
