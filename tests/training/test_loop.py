"""The training loop in process: what it keeps when an eval fails, how far the host runs ahead, and the names callers
import from it."""
import logging

import jax
import pytest

from configs import template
from xattn_jax.training import checkpoints, loop, trainer

# A tiny run: a 2-step call, then the eval at step 2; the first checkpoint would be at step 100.
OVERRIDES = {"total_steps": 4, "batch_size": 8, "eval_batch_size": 8, "task.num_eval_examples": 8,
             "log_every_steps": 1, "eval_every_steps": 2, "checkpoint.every_steps": 100,
             "steps_per_call": 2, "logging.tensorboard": False, "logging.plot": False}


def test_an_eval_that_fails_saves_the_trained_state_first(tmp_path, monkeypatch):
  """An eval crash (a bug, a bad plot setting) at the first eval used to lose every step trained."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict(OVERRIDES)

  def failing_evaluate(self, state):
    raise RuntimeError("eval broke")

  monkeypatch.setattr(trainer.Trainer, "evaluate", failing_evaluate)
  with pytest.raises(RuntimeError, match="eval broke"):
    loop.run(config, str(tmp_path / "run"))
  assert checkpoints.step_numbers(str(tmp_path / "run")) == [2]  # the first eval step


@pytest.mark.parametrize("name", ["run", "load_model", "multi_step", "model_rngs", "check_same_model",
                                  "steps_per_call", "TrainingDiverged", "RunError", "DataError"])
def test_the_names_scripts_use_stay_importable_from_the_loop(name):
  """launch.py, the tasks, experiments/ and the README reach these as loop.<name>."""
  assert hasattr(loop, name)


@pytest.mark.parametrize("path, level, message, kept", [
    ("/site-packages/orbax/checkpoint/checkpoint_manager.py", logging.WARNING,
     "Requested `tracked_metric`; did not provide metrics.", False),  # at every checkpoint without an eval
    ("/site-packages/orbax/checkpoint/checkpoint_manager.py", logging.INFO, "Saving checkpoint", False),
    ("/site-packages/orbax/checkpoint/checkpoint_manager.py", logging.WARNING, "disk full", True),
    ("/work/xattn_jax/training/progress.py", logging.INFO, "step 8/16: loss 1.0", True),
])
def test_the_run_log_keeps_warnings_and_its_own_lines_but_not_library_chatter(path, level, message, kept):
  record = logging.LogRecord("x", level, path, 1, message, None, None)
  assert loop.keep_library_record(record) is kept


def test_the_host_runs_at_most_one_call_ahead_so_a_stop_waits_for_one_call(tmp_path, monkeypatch):
  """SIGTERM is read after each dispatched call; a stop saves once the calls already queued are done. The host
  dispatches a call only once the call before the previous one is done, so at most one earlier call is still
  queued or running. Without that it dispatched every call up to the next log row, and a stop waited for a
  whole logging window."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({**OVERRIDES, "total_steps": 48, "log_every_steps": 48, "eval_every_steps": 48,
                                     "steps_per_call": 1})
  unfinished, outputs = [], []
  make_train_step = trainer.Trainer.make_train_step

  def counting_make_train_step(self):
    train_step = make_train_step(self)

    def counted(*args):
      unfinished.append(sum(not all(leaf.is_ready() for leaf in jax.tree.leaves(metrics)) for metrics in outputs))
      state, metrics = train_step(*args)
      outputs.append(metrics)
      return state, metrics
    return counted

  monkeypatch.setattr(trainer.Trainer, "make_train_step", counting_make_train_step)
  loop.run(config, str(tmp_path / "run"))
  assert len(unfinished) == 48 and max(unfinished) <= 1, unfinished
