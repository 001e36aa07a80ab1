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
