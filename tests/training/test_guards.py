"""What stops training: a non-finite loss or gradient norm, SIGTERM / Ctrl-C, the multi-host vote."""
import math
import signal
import threading

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from xattn_jax.training import guards
from xattn_jax.training.sharding import make_mesh


@pytest.mark.parametrize("name,value", [("train/loss", math.nan), ("train/grad_norm", math.inf),
                                        ("train/loss", -math.inf)])
def test_a_non_finite_loss_or_gradient_norm_stops_naming_the_metric_step_and_last_checkpoint(name, value):
  values = {"train/loss": 1.0, "train/grad_norm": 2.0, name: value}
  with pytest.raises(guards.TrainingDiverged,
                     match=rf"^{name} = {value} at step 6; stopping. Last checkpoint: step 4 \(left untouched\)$"):
    guards.check_finite(6, values, lambda: [2, 4])


def test_a_divergence_before_any_checkpoint_says_none():
  with pytest.raises(guards.TrainingDiverged, match="Last checkpoint: none"):
    guards.check_finite(1, {"train/loss": math.nan, "train/grad_norm": 1.0}, lambda: [])


def test_finite_values_pass_without_listing_the_checkpoints():
  def never():
    raise AssertionError("the checkpoints are listed only for a divergence")

  guards.check_finite(3, {"train/loss": np.float32(2.5), "train/grad_norm": np.float32(0.1)}, never)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_a_first_ctrl_c_sets_the_stop_flag(signum):
  with guards.stop_flag() as flag:
    assert not flag.requested
    signal.raise_signal(signum)
    assert flag.requested


def test_a_second_ctrl_c_interrupts_at_once():
  with guards.stop_flag():
    signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)


def test_the_previous_signal_handlers_come_back_afterwards():
  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with guards.stop_flag():
    assert signal.getsignal(signal.SIGTERM) != before[0]
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_without_a_vote_the_stop_request_is_the_flag():
  flag = guards.StopFlag()
  requests = guards.StopRequests(flag)
  assert not requests.after_call(1)
  flag.requested = True
  assert requests.after_call(2)


def _one_device_mesh():
  return make_mesh(ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), devices=jax.devices()[:1])


def test_the_stop_vote_is_the_or_of_every_devices_flag():
  vote = guards.stop_vote(_one_device_mesh())
  assert bool(vote(True)) and not bool(vote(False))


def test_with_a_vote_every_process_stops_one_call_after_the_signal():
  """The vote dispatched after call n is read after call n + 1: no process waits for its last call."""
  flag = guards.StopFlag()
  requests = guards.StopRequests(flag, guards.stop_vote(_one_device_mesh()))
  assert not requests.after_call(1)
  flag.requested = True
  assert not requests.after_call(2)  # this call's vote is dispatched, not yet read
  assert requests.after_call(3)


def test_off_the_main_thread_the_stop_flag_installs_no_handler():
  """Python allows signal handlers only on the main thread: a loop run from another one still trains."""
  before, seen = signal.getsignal(signal.SIGTERM), []

  def body():
    with guards.stop_flag() as flag:
      seen.append((flag.requested, signal.getsignal(signal.SIGTERM)))

  thread = threading.Thread(target=body)
  thread.start()
  thread.join()
  assert seen == [(False, before)]


def _early_stopping(patience, mode="min", min_delta=0.0, rows=(), up_to_step=0):
  config = ConfigDict({"early_stopping": {"patience": patience, "min_delta": min_delta},
                       "checkpoint": {"best_metric": "eval/loss", "best_mode": mode}})
  return guards.EarlyStopping(config, rows, up_to_step=up_to_step)


def _stops(watcher, values, first_step=4, every=4):
  return [watcher.after_eval(first_step + every * i, {} if v is None else {"eval/loss": v})
          for i, v in enumerate(values)]


@pytest.mark.parametrize("mode, values, min_delta, stops", [
    ("min", [3.0, 2.0, 2.5, 2.1, 1.9, 2.0, 2.0], 0.0, [False, False, False, True, False, False, True]),
    ("min", [3.0, 2.95, 2.91, 2.5], 0.1, [False, False, True, False]),  # gains under min_delta do not count
    ("max", [0.1, 0.5, 0.5, 0.4], 0.0, [False, False, False, True]),  # equal is no gain
    ("min", [3.0, None, None], 0.0, [False, False, True]),  # an eval without the metric is no gain
])
def test_early_stopping_ends_after_patience_evals_without_beating_the_best(mode, values, min_delta, stops):
  assert _stops(_early_stopping(2, mode, min_delta), values) == stops


def test_a_tie_is_no_gain_and_the_best_eval_is_the_first_to_reach_the_best_value():
  watcher = _early_stopping(2, "max")
  assert _stops(watcher, [0.5, 1.0, 1.0, 1.0]) == [False, False, False, True]
  assert (watcher.best, watcher.best_step) == (1.0, 8)
  assert "eval/loss has not beaten its best 1 at step 8 by more than" in watcher.reason()


def test_a_gain_under_min_delta_moves_the_best_eval_but_not_the_reference_patience_counts_from():
  watcher = _early_stopping(2, "min", min_delta=0.1)
  assert _stops(watcher, [3.0, 2.0, 1.95, 1.94]) == [False, False, False, True]
  assert (watcher.reference, watcher.reference_step, watcher.best, watcher.best_step) == (2.0, 8, 1.94, 16)
  assert "has not beaten step 8's 2 by more than early_stopping.min_delta=0.1" in watcher.reason()
  assert "its best, step 16's 1.94" in watcher.reason()


def test_early_stopping_off_never_stops():
  assert not any(_stops(_early_stopping(0), [1.0, 2.0, 3.0, 4.0]))


def test_a_resumed_run_replays_its_logged_evals_and_stops_where_the_whole_run_stops():
  values = [3.0, 2.0, 2.5, 2.6, 2.7]
  whole = _stops(_early_stopping(3), values)
  assert whole == [False, False, False, False, True]
  rows = [{"step": 4 * (i + 1), "eval/loss": v, "train/loss": 1.0} for i, v in enumerate(values)]
  rows += [{"step": 13, "train/loss": 1.0}]  # train rows and rows past the checkpoint are not evals counted
  resumed = _early_stopping(3, rows=rows, up_to_step=12)  # checkpoint 12: evals 4, 8, 12 replayed
  assert (resumed.reference, resumed.best_step, resumed.evals_since_best) == (2.0, 8, 1)
  assert _stops(resumed, values[3:], first_step=16) == whole[3:]
  assert "eval/loss has not beaten its best 2 at step 8" in resumed.reason()

