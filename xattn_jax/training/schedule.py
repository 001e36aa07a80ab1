"""Which steps each jitted call runs, and what follows it (log, eval, checkpoint).

One call runs `config.steps_per_call` consecutive steps (see `trainer.multi_step`), cut short so that
every eval, every checkpoint and the last step end a call (they read the state after that step), and
where the batches change shape (length bucketing). Steps count completed updates: the call starting
after step s runs steps s + 1 ... s + count, reading train batches s ... s + count - 1.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np


def steps_per_call(config) -> int:
  """config.steps_per_call; 1 (the behaviour before the field existed) in an older run's config.py."""
  return config.get("steps_per_call", 1)


def end_step(config, steps_per_epoch: int | None) -> int:
  """Where training ends: config.total_steps, or with config.max_epochs > 0 the step that completes that
  many passes over the training data (`steps_per_epoch` steps each, the task's count) when it comes first,
  but never before config.min_steps. Older run configs have neither field: total_steps."""
  epochs = config.get("max_epochs", 0.0)
  if not epochs:
    return config.total_steps
  if steps_per_epoch is None or steps_per_epoch < 1:
    raise ValueError(f"steps_per_epoch={steps_per_epoch}: max_epochs={epochs} needs the task's count of steps "
                     "in one pass over its training data")
  return min(config.total_steps, max(passes_step(epochs, steps_per_epoch), config.get("min_steps", 0)))


def passes_step(epochs: float, steps_per_epoch: int) -> int:
  """The step that completes `epochs` passes of `steps_per_epoch` steps."""
  return int(np.ceil(epochs * steps_per_epoch))


def stack_depth(config) -> int:
  """The most steps any call can run (the stacked batches' leading size): steps_per_call, capped by
  the loop's lengths."""
  return min(steps_per_call(config), config.total_steps, config.eval_every_steps, config.checkpoint.every_steps)


def steps_in_call(step: int, config) -> int:
  """How many steps the call starting after `step` runs: config.steps_per_call, cut short so that
  every eval, checkpoint and the last step end a call. (`CallFeed` cuts it shorter where the
  batches change shape.)"""
  if not 0 <= step < config.total_steps:
    raise ValueError(f"step={step}: a call starts after a step in [0, total_steps={config.total_steps})")
  count = min(steps_per_call(config), config.total_steps - step)
  for every in (config.eval_every_steps, config.checkpoint.every_steps):
    count = min(count, every - step % every)
  return count


def last_call_start(config, start: int = 0) -> int:
  """The step after which the last call of a run that starts after `start` begins: calls of steps_per_call steps
  from `start`, cut at every eval and checkpoint (length bucketing may cut them more)."""
  last, size = config.total_steps - 1, steps_per_call(config)
  boundary = max(start, *(last // every * every for every in (config.eval_every_steps, config.checkpoint.every_steps)))
  return boundary + (last - boundary) // size * size


@dataclasses.dataclass(frozen=True)
class CallEnd:
  """What the loop does after a call that ended at some step."""
  evaluate: bool  # an eval step (every eval_every_steps, and the last)
  checkpoint: bool  # a checkpoint step (every checkpoint.every_steps, and the last)
  log: bool  # the call ran a step whose metrics are logged (every log_every_steps, and the last)


def call_end(step: int, count: int, config) -> CallEnd:
  """The CallEnd of a call of `count` steps that ended at `step` (its last step)."""
  if not 1 <= count <= step:
    raise ValueError(f"count={count}: a call that ended at step {step} ran 1 ... {step} steps")
  is_last = step == config.total_steps
  every_log = config.log_every_steps
  return CallEnd(evaluate=step % config.eval_every_steps == 0 or is_last,
                 checkpoint=step % config.checkpoint.every_steps == 0 or is_last,
                 log=step // every_log > (step - count) // every_log or is_last)


def logged(step: int, config) -> bool:
  """Whether step `step`'s train metrics are logged: every log_every_steps, and the last step."""
  return step % config.log_every_steps == 0 or step == config.total_steps


def _shapes(batch) -> tuple:
  return tuple(np.shape(x) for x in jax.tree.leaves(batch))


class CallFeed:
  """The train batches of each call, stacked on a leading axis of `stack_depth(config)`.

  `read_batch(index)` returns this process's rows of train batch `index` (0-based). A call takes
  `steps_in_call` batches, fewer when one has another shape than the call's first (length
  bucketing): that batch is held over and opens the next call. The stack is filled up with copies
  of the call's last batch (rows the call does not run), so every call of one batch shape has one
  program shape.
  """

  def __init__(self, read_batch: Callable[[int], dict], config):
    self.read_batch = read_batch
    self.config = config
    self.held: dict[int, dict] = {}  # batch index -> a batch read for a call it did not fit

  def next_call(self, step: int) -> tuple[dict, int]:
    """(stacked local batches [stack_depth, ...] per array, count) for the call starting after `step`."""
    batches = []
    for index in range(step, step + steps_in_call(step, self.config)):
      batch = self.held.pop(index) if index in self.held else self.read_batch(index)
      if batches and _shapes(batch) != _shapes(batches[0]):
        self.held[index] = batch
        break
      batches.append(batch)
    count = len(batches)
    batches += batches[-1:] * (stack_depth(self.config) - count)
    return jax.tree.map(lambda *rows: np.stack(rows), *batches), count
