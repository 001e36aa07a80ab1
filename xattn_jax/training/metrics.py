"""The run's record: `metrics.jsonl` (one JSON object per line, flushed), TensorBoard, a loss plot.

Only process 0 writes. On resume, lines past the restored step are dropped first, so the file reads
as one uninterrupted run. A metric that is undefined at a step (None) is left out of that step's
line and its TensorBoard scalars: a reader sees no value, never a 0 that reads as a score.
"""
from __future__ import annotations

import json
import math
import os
import shutil

from absl import logging

from xattn_jax.training import records


def read_metrics(path: str) -> list[dict]:
  """Every row of a metrics.jsonl (`records.read_rows`: a last line cut off by a kill is skipped; another
  damaged line is a DataError naming it, before a resume rewrites the file without it)."""
  return records.read_rows(path, "mend or delete that line (copy the file first to keep it): training on "
                           "rewrites metrics.jsonl from the rows it reads")


class MetricsWriter:
  """Appends metrics rows to `<workdir>/metrics.jsonl` and TensorBoard; a no-op off process 0."""

  def __init__(self, workdir: str, *, active: bool, tensorboard: bool, resume_step: int = 0):
    self.active = active
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = None
    self._tensorboard = None
    if not active:
      return
    self._truncate_after(resume_step)
    self._file = open(self.path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter  # imports torch when installed: only when asked for
      self._tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

  def _truncate_after(self, step: int):
    """Drops the rows after the step training resumes from (it logs them again), keeping a copy of the
    file in metrics.jsonl.before_step_<step> when it drops any: they may be all that is left of a run
    whose checkpoints are gone."""
    rows = read_metrics(self.path)
    kept = [row for row in rows if row.get("step", 0) <= step]
    if len(kept) < len(rows):
      shutil.copyfile(self.path, f"{self.path}.before_step_{step}")
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      for row in kept:
        f.write(json.dumps(row) + "\n")
    os.replace(tmp, self.path)

  def write(self, step: int, values: dict):
    """One line `{"step": step, **values}` and one TensorBoard scalar per value; values that are None
    (undefined) are left out of both, non-finite floats are written to the line as strings."""
    if not self.active:
      return
    values = {key: float(value) for key, value in values.items() if value is not None}
    row = {"step": int(step)}
    for key, value in values.items():
      row[key] = value if math.isfinite(value) else str(value)
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tensorboard is not None:
      for key, value in values.items():
        self._tensorboard.add_scalar(key, value, step)
      self._tensorboard.flush()

  def close(self):
    if self._file is not None:
      self._file.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def plot_losses(workdir: str):
  """Writes `<workdir>/loss.png`: train loss per logged step, and eval loss where computed."""
  rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  train = [(r["step"], r["train/loss"]) for r in rows if isinstance(r.get("train/loss"), float)]
  evals = [(r["step"], r["eval/loss"]) for r in rows if isinstance(r.get("eval/loss"), float)]
  if not train:
    return
  try:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
  except ImportError:
    logging.warning("matplotlib is not installed: no loss plot")
    return
  fig, ax = plt.subplots(figsize=(6, 4))
  # A single logged step (a run of one step, or one shorter than log_every_steps: its last step only) is a
  # line of one point, which matplotlib draws as nothing: a marker shows it.
  ax.plot(*zip(*train), marker="o" if len(train) == 1 else None, label="train/loss")
  if evals:
    ax.plot(*zip(*evals), "o-", label="eval/loss")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_yscale("log")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "loss.png"), dpi=100)
  plt.close(fig)
