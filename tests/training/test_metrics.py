"""The metrics record of a workdir."""
import sys
import types


def test_resuming_drops_later_metric_rows_but_keeps_a_copy_of_them(tmp_path):
  from xattn_jax.training import metrics
  writer = metrics.MetricsWriter(str(tmp_path), active=True, tensorboard=False)
  for step in (1, 2, 3):
    writer.write(step, {"train/loss": float(step)})
  writer.close()
  metrics.MetricsWriter(str(tmp_path), active=True, tensorboard=False, resume_step=1).close()
  assert [row["step"] for row in metrics.read_metrics(str(tmp_path / "metrics.jsonl"))] == [1]
  copy = metrics.read_metrics(str(tmp_path / "metrics.jsonl.before_step_1"))
  assert [row["step"] for row in copy] == [1, 2, 3]



def test_the_loss_plot_of_a_single_logged_step_draws_it(tmp_path, monkeypatch):
  """A run of one step (or one shorter than log_every_steps) logs one train row: its line of one point drew
  nothing in loss.png but the legend."""
  from matplotlib import pyplot as plt

  from xattn_jax.training import metrics
  writer = metrics.MetricsWriter(str(tmp_path), active=True, tensorboard=False)
  writer.write(1, {"train/loss": 4.6, "eval/loss": 5.0})
  writer.close()
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  metrics.plot_losses(str(tmp_path))
  assert (tmp_path / "loss.png").exists()
  lines = figures[0].axes[0].get_lines()
  assert [line.get_label() for line in lines] == ["train/loss", "eval/loss"]
  for line in lines:  # a line of several points, or a marker
    assert len(line.get_xdata()) > 1 or line.get_marker() not in (None, "None", "", " ")
  monkeypatch.undo()  # plt.close again
  plt.close(figures[0])


class _FakeSummaryWriter:
  """tensorboardX.SummaryWriter's calls, recorded."""
  scalars = []

  def __init__(self, logdir, purge_step=None):
    del logdir, purge_step

  def add_scalar(self, key, value, step):
    self.scalars.append((key, value, step))

  def flush(self):
    pass

  def close(self):
    pass


def test_undefined_values_are_left_out_of_metrics_jsonl_and_tensorboard(tmp_path, monkeypatch):
  from xattn_jax.training import metrics
  monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=_FakeSummaryWriter))
  monkeypatch.setattr(_FakeSummaryWriter, "scalars", [])
  writer = metrics.MetricsWriter(str(tmp_path), active=True, tensorboard=True)
  writer.write(4, {"eval/loss": 0.5, "eval/bleu": None, "eval/chrf": 99.0})
  writer.close()
  assert metrics.read_metrics(str(tmp_path / "metrics.jsonl")) == [{"step": 4, "eval/loss": 0.5, "eval/chrf": 99.0}]
  assert _FakeSummaryWriter.scalars == [("eval/loss", 0.5, 4), ("eval/chrf", 99.0, 4)]


def test_a_best_checkpoint_policy_saves_and_keeps_steps_whose_eval_lacks_its_metric(tmp_path):
  """An eval that leaves the best metric out (undefined there) is saved like a step without eval."""
  import jax.numpy as jnp
  from xattn_jax.training import checkpoints as checkpoints_lib
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/bleu", best_mode="max")
  for step, metrics in ((1, {"eval/bleu": 40.0}), (2, {"eval/loss": 1.0}), (3, {"eval/loss": 0.5})):
    checkpoints.save(step, {"w": jnp.full((2,), float(step))}, {"count": jnp.asarray(step)}, {"step": step}, metrics)
  assert checkpoints.steps() == [1, 3]
  checkpoints.close()

# --- several steps per call ---------------------------------------------------------------------
