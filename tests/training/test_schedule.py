"""Which steps each jitted call runs: call boundaries, what follows a call, the batches it reads."""
import numpy as np
import pytest
from ml_collections import ConfigDict

from configs import common
from xattn_jax.training import schedule


def _config(steps_per_call=4, total=20, eval_every=5, checkpoint_every=7, log_every=1):
  config = common.base_config(total_steps=total, eval_every_steps=eval_every,
                              checkpoint_every_steps=checkpoint_every, log_every_steps=log_every)
  config.steps_per_call = steps_per_call
  return config


@pytest.mark.parametrize("steps_per_call,total,eval_every,checkpoint_every", [
    (4, 20, 5, 7), (8, 8, 4, 4), (1, 6, 2, 3), (16, 50, 10, 25), (3, 7, 100, 100)])
def test_calls_end_at_every_eval_checkpoint_and_the_last_step(steps_per_call, total, eval_every, checkpoint_every):
  config = _config(steps_per_call, total, eval_every, checkpoint_every)
  step, ends = 0, []
  while step < total:
    count = schedule.steps_in_call(step, config)
    assert 1 <= count <= schedule.stack_depth(config) <= steps_per_call
    step += count
    ends.append(step)
  must_end = {s for s in range(1, total + 1) if s % eval_every == 0 or s % checkpoint_every == 0} | {total}
  assert must_end <= set(ends)
  # Calls are cut only there: every call that does not end at one of those steps is full length.
  starts = [0] + ends[:-1]
  assert all(b - a == steps_per_call for a, b in zip(starts, ends) if b not in must_end)


@pytest.mark.parametrize("steps_per_call,total,eval_every,checkpoint_every,start", [
    (4, 20, 5, 7, 0), (16, 8, 500, 500, 0), (8, 1000, 500, 500, 0), (3, 7, 100, 100, 2), (4, 20, 5, 7, 15)])
def test_last_call_start_is_where_the_walked_calls_last_begin(steps_per_call, total, eval_every, checkpoint_every,
                                                              start):
  config = _config(steps_per_call, total, eval_every, checkpoint_every)
  step = start
  while step + schedule.steps_in_call(step, config) < total:
    step += schedule.steps_in_call(step, config)
  assert schedule.last_call_start(config, start) == step


@pytest.mark.parametrize("step", [-1, 20, 21])
def test_a_call_must_start_inside_the_run(step):
  with pytest.raises(ValueError, match=f"step={step}"):
    schedule.steps_in_call(step, _config(total=20))


def test_a_config_without_steps_per_call_runs_one_step_per_call():
  """A run's config.py from before the field existed."""
  config = ConfigDict({"total_steps": 10, "eval_every_steps": 5, "checkpoint": {"every_steps": 5}})
  assert schedule.steps_per_call(config) == 1 == schedule.steps_in_call(0, config)


def test_stack_depth_is_capped_by_the_shortest_interval():
  assert schedule.stack_depth(_config(steps_per_call=16, total=20, eval_every=5, checkpoint_every=7)) == 5
  assert schedule.stack_depth(_config(steps_per_call=2, total=20, eval_every=5, checkpoint_every=7)) == 2


def test_call_end_names_the_eval_checkpoint_and_log_steps():
  config = _config(total=20, eval_every=5, checkpoint_every=7, log_every=3)
  assert schedule.call_end(5, 4, config) == schedule.CallEnd(evaluate=True, checkpoint=False, log=True)
  assert schedule.call_end(14, 1, config) == schedule.CallEnd(evaluate=False, checkpoint=True, log=False)
  assert schedule.call_end(11, 4, config) == schedule.CallEnd(evaluate=False, checkpoint=False, log=True)  # 9
  assert schedule.call_end(20, 1, config) == schedule.CallEnd(evaluate=True, checkpoint=True, log=True)


def test_call_end_rejects_a_count_the_step_cannot_have():
  with pytest.raises(ValueError, match="count=5"):
    schedule.call_end(4, 5, _config())


def test_logged_steps_are_every_log_interval_and_the_last():
  config = _config(total=10, log_every=4)
  assert [s for s in range(1, 11) if schedule.logged(s, config)] == [4, 8, 10]


def _feed(lengths, config):
  """A CallFeed over batches whose `x` is [2, lengths[index]] filled with the batch index."""
  reads = []

  def read_batch(index):
    reads.append(index)
    return {"x": np.full((2, lengths[index]), index)}

  return schedule.CallFeed(read_batch, config), reads


def test_a_call_reads_its_batches_in_order_and_pads_the_stack_with_the_last():
  config = _config(steps_per_call=4, total=20, eval_every=10, checkpoint_every=10)
  feed, _ = _feed([3] * 20, config)
  stacked, count = feed.next_call(0)
  assert count == 4 and stacked["x"].shape == (4, 2, 3)
  np.testing.assert_array_equal(stacked["x"][:, 0, 0], [0, 1, 2, 3])
  stacked, count = feed.next_call(8)  # cut at the step-10 eval: 2 steps, stack filled with batch 9
  assert count == 2
  np.testing.assert_array_equal(stacked["x"][:, 0, 0], [8, 9, 9, 9])


def test_a_batch_of_another_shape_ends_the_call_and_opens_the_next():
  config = _config(steps_per_call=4, total=20, eval_every=10, checkpoint_every=10)
  feed, reads = _feed([3, 3, 5, 5, 5, 5, 5], config)
  stacked, count = feed.next_call(0)
  assert count == 2 and stacked["x"].shape == (4, 2, 3)
  stacked, count = feed.next_call(2)
  assert count == 4 and stacked["x"].shape == (4, 2, 5)
  np.testing.assert_array_equal(stacked["x"][:, 0, 0], [2, 3, 4, 5])
  assert reads == [0, 1, 2, 3, 4, 5]  # batch 2 was read once, held over for the second call


@pytest.mark.parametrize("epochs, per_epoch, min_steps, end", [
    (0.0, None, 0, 20),   # off: total_steps alone, whatever the task counts
    (3.0, 4, 0, 12),      # three passes of 4 steps
    (2.5, 3, 0, 8),       # a part pass rounds up to a whole step
    (3.0, 4, 15, 15),     # not before min_steps
    (10.0, 4, 0, 20),     # never past total_steps
    (0.5, 1, 0, 1),       # data smaller than a batch: an epoch is one step
])
def test_max_epochs_ends_the_run_after_that_many_passes_between_min_steps_and_total_steps(epochs, per_epoch,
                                                                                            min_steps, end):
  config = _config(total=20)
  config.max_epochs, config.min_steps = epochs, min_steps
  assert schedule.end_step(config, per_epoch) == end


def test_max_epochs_needs_the_tasks_count_and_older_configs_end_at_total_steps():
  config = _config(total=20)
  config.max_epochs = 2.0
  with pytest.raises(ValueError, match="steps_per_epoch=None: max_epochs=2.0"):
    schedule.end_step(config, None)
  older = ConfigDict({"total_steps": 10, "eval_every_steps": 5, "checkpoint": {"every_steps": 5}})
  assert schedule.end_step(older, 3) == 10
