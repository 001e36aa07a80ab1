"""The metrics record of a workdir."""


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


# --- several steps per call ---------------------------------------------------------------------
