"""Sharded and multi-process training give the single-device losses: 8 simulated CPU devices under two meshes
(fsdp alone; data x fsdp x tensor), one device a core, and two processes on 127.0.0.1 with two devices each."""
import json
import shutil
import signal
import socket
import sys

import numpy as np
import pytest

from tests import helpers
from xattn_jax.training import distributed
from tests.training import test_launch
from tests.training.test_launch import (OVERRIDES, REPO, STEPS, checkpoint_steps, launch_args, metrics_rows, train_losses,
                                        wait_for)

# The runs here are compared to 1e-5, not bit for bit: XLA:CPU's older fusion emitters (the faster compile,
# tests/xla_flags.py) serve, in every run of this file.


def subprocess_env(device_count=1):
  return test_launch.subprocess_env(device_count, fusion_emitters=False)


def launch(workdir, *extra, **kwargs):
  return test_launch.launch(workdir, *extra, fusion_emitters=False, **kwargs)


def start(workdir, *extra, **kwargs):
  return test_launch.start(workdir, *extra, fusion_emitters=False, **kwargs)

# A data-only mesh gives the single device's losses in the cpu_devices and two-process tests below; here the axes
# that shard the parameters, alone and beside the others.
MESHES = {
    "data2_fsdp2_tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp8": {"data": 1, "fsdp": 8, "tensor": 1},
}

# One process, every mesh's run: imports and device setup are paid once.
_RUN_MESHES = """
import json, sys
from configs import template
from xattn_jax.training import loop
overrides, meshes, root = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
for name, mesh in meshes.items():
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({**overrides, **{"mesh." + k: v for k, v in mesh.items()}})
  loop.run(config, f"{root}/{name}")
"""


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("single") / "run"
  result = launch(workdir)
  assert result.returncode == 0, result.stderr[-3000:]
  return train_losses(workdir)


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  root = tmp_path_factory.mktemp("meshes")
  result = helpers.run([sys.executable, "-c", _RUN_MESHES, json.dumps(OVERRIDES), json.dumps(MESHES), str(root)],
                       cwd=REPO, env=subprocess_env(device_count=8), timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return root


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_sharded_mesh_gives_the_single_device_losses(eight_devices, single_device, mesh):
  losses = train_losses(eight_devices / mesh)
  assert sorted(losses) == sorted(single_device)
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [single_device[s] for s in sorted(single_device)], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_run_saved_on_a_sharded_mesh_evaluates_and_resumes_on_one_device(eight_devices, tmp_path):
  """A run trained on a pod's mesh, read on a laptop: its checkpoint is restored onto the one-device mesh (orbax
  reshards), scores its step-8 eval loss again and trains on; its own config.py, which names the 8-device mesh,
  is refused naming the mesh and the fields that fit this machine."""
  run = tmp_path / "run"
  shutil.copytree(eight_devices / "data2_fsdp2_tensor2", run)
  own = helpers.run([sys.executable, str(REPO / "launch.py"), f"--config={run / 'config.py'}", f"--workdir={run}",
                     "--mode=eval"], cwd=REPO, env=subprocess_env(1), timeout=300)
  assert own.returncode == 2 and "needs 8 devices, but 1 are available" in own.stderr, own.stderr[-2000:]
  assert "--config.mesh.data=-1 --config.mesh.fsdp=1 --config.mesh.tensor=1" in own.stderr
  result = launch(run, "--mode=eval")  # the template config: the default mesh, every device on "data"
  assert result.returncode == 0, result.stderr[-3000:]
  evaluated = json.loads((run / "eval_results.jsonl").read_text().splitlines()[-1])
  logged = {row["step"]: row for row in metrics_rows(run)}[STEPS]
  assert evaluated["step"] == STEPS
  np.testing.assert_allclose(evaluated["eval/loss"], logged["eval/loss"], rtol=1e-5)
  result = launch(run, overrides={"total_steps": STEPS + 4})
  assert result.returncode == 0, result.stderr[-3000:]
  assert checkpoint_steps(run)[-1] == STEPS + 4 and max(train_losses(run)) == STEPS + 4


def test_load_model_reads_a_run_of_a_larger_mesh_onto_this_process_s_devices(eight_devices):
  """From a notebook (this process: one device) the 8-device run's own mesh was refused, with launch.py's flags."""
  from xattn_jax.training import inference
  model, task = inference.load_model(str(eight_devices / "data2_fsdp2_tensor2"))
  assert dict(task.config.mesh) == {"data": -1, "fsdp": 1, "tensor": 1}
  answers = task.infer(model, ["abc", "", "hello"])  # 8 steps of training: letters, not yet the reversal
  assert answers[1] == "" and all(answer.isalpha() for answer in (answers[0], answers[2])), answers


# An untrained translator (its greedy outputs are long and varied) decoding 32 eval sources on a
# data2_fsdp2_tensor2 mesh: rows split over the data axes, against the same decode fed replicated rows.
_DECODE_SHARDED = """
import functools, json, sys
import numpy as np
from configs import translate_dates
from xattn_jax.training.trainer import Trainer
config = translate_dates.get_config("tokenizer=bytes")
config.update_from_flattened_dict({"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "eval_batch_size": 16,
                                   "model.max_length": 32, "data.first_year": 2000, "data.last_year": 2001,
                                   **{f"model.{side}.{k}": v for side in ("encoder", "decoder")
                                      for k, v in (("d_model", 32), ("num_layers", 1), ("mlp_dim", 64))}})
trainer = Trainer(config, sys.argv[1])
import jax, jax.numpy as jnp
state = jax.tree.map(lambda x: x * 4 if jnp.issubdtype(x.dtype, jnp.floating) else x, trainer.init_state())
model, task = trainer.model(state), trainer.task  # weights scaled up: sharper, more varied outputs
inputs = np.concatenate([b["inputs"] for b in task.eval_data.eval_batches(16)])[:20]  # 2 chunks, one padded
seen = []
generate = task._generate
task._generate = lambda model, rows, **kw: (seen.append(len(rows.sharding.device_set)), generate(model, rows, **kw))[1]
sharded = task.translate_ids(model, inputs, 12)
task.rows_sharding = None
replicated = task.translate_ids(model, inputs, 12)
devices = list(seen)  # the greedy calls' (the beam calls append theirs)

# Beam search with the vocabulary split over tensor (the trainer's task.logits_sharding: candidates ranked on
# each device) against the same search ranking the whole vocabulary.
from xattn_jax import decoding
task.rows_sharding, task.options = trainer.batch_sharding, decoding.DecodingOptions(method="beam", beam_size=3)
logits_sharding = task.logits_sharding
beam_split = task.translate_ids(model, inputs, 12)
task.logits_sharding = None
beam_whole = task.translate_ids(model, inputs, 12)
# The top-k itself, with ties (values on a grid of halves), rows over data x fsdp and the vocabulary over tensor:
# the same values and ids as lax.top_k, and no all-gather of the whole vocabulary (lax.top_k gathers it).
import re
from jax.sharding import NamedSharding, PartitionSpec
scores = np.round(np.random.default_rng(1).normal(size=(8, 3, 40)) * 2).astype(np.float32) / 2
placed_scores = jax.device_put(scores, NamedSharding(logits_sharding.mesh, PartitionSpec(("data", "fsdp"), None,
                                                                                          "tensor")))
split_top = jax.jit(lambda x: decoding._split_top_k(x, 5, logits_sharding))
whole_top = jax.jit(lambda x: jax.lax.top_k(x, 5))
def gathered_widths(f):  # the last dimension of every all-gather's result
  return sorted({int(m.group(1)) for m in re.finditer(r"= f32\\[[\\d,]*?(\\d+)\\]\\{[^}]*\\} all-gather\\(",
                                                          f.lower(placed_scores).compile().as_text())})
top_k = {"equal": [np.array_equal(a, b) for a, b in zip(split_top(placed_scores), whole_top(scores))],
         "split_gathers": gathered_widths(split_top), "whole_gathers": gathered_widths(whole_top),
         "spec": str(logits_sharding.spec)}

# A language model placed tensor-parallel on 2 of the devices (sharding.place_model, the benchmarks' placement):
# its kernels split over the heads / MLP axes, a greedy decode the same tokens as the model on one device.
from flax import nnx
from configs import common
from xattn_jax import decoding
from xattn_jax.models import lm as lm_lib
from xattn_jax.training import sharding
lm = lm_lib.LanguageModel(62, d_model=32, num_heads=4, num_layers=2, mlp_dim=64, max_length=24, rngs=nnx.Rngs(3))
nnx.update(lm, jax.tree.map(lambda x: x * 4, nnx.state(lm, nnx.Param)))  # sharper, more varied outputs
mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 2}, jax.devices()[:2])
placed = sharding.place_model(lm, mesh, common.DEFAULT_SHARDING_RULES)
graphdef = nnx.graphdef(lm)

@jax.jit
def greedy(state, prompt):
  model = nnx.merge(graphdef, state)
  logits, cache = model.prefill(prompt, model.init_cache(prompt.shape[0], 24))
  return decoding.greedy_search(model.loop_step(), cache, batch_size=prompt.shape[0], max_length=16, bos_id=1,
                                eos_id=62, pad_id=0, first_tokens=jnp.argmax(logits[:, -1], -1)).tokens

prompt = np.random.default_rng(0).integers(3, 61, (4, 8)).astype(np.int32)
wi = placed.blocks.mlp.wi.kernel.get_value()  # [layers, d_model, mlp_dim]
lm_out = {"tokens": np.asarray(greedy(nnx.state(lm), prompt)).tolist(),
          "tensor_parallel": np.asarray(greedy(nnx.state(placed), prompt)).tolist(),
          "mlp_devices": len(wi.sharding.device_set), "mlp_shard": list(wi.addressable_shards[0].data.shape),
          "vocab_shard": list(placed.embed.embedding.get_value().addressable_shards[0].data.shape)}

# Beam search and top-k sampling on the tensor-parallel LM, candidates ranked per device: its one-device tokens.
lm_sharding = sharding.logits_sharding(mesh, common.DEFAULT_SHARDING_RULES)

@functools.partial(jax.jit, static_argnames="split")
def searches(state, prompt, split):
  model = nnx.merge(graphdef, state)
  logits, cache = model.prefill(prompt, model.init_cache(prompt.shape[0], 24))
  common_args = dict(batch_size=prompt.shape[0], max_length=16, bos_id=1, eos_id=62, pad_id=0,
                     first_tokens=jnp.argmax(logits[:, -1], -1), logits_sharding=lm_sharding if split else None)
  beams = decoding.beam_search(model.loop_step(), cache, beam_size=3, **common_args).tokens
  drawn = decoding.sample_search(model.loop_step(), cache, rng=jax.random.key(5), top_k=4, **common_args).tokens
  return beams, drawn

lm_out["beam"], lm_out["sample"] = [np.asarray(t).tolist() for t in searches(nnx.state(lm), prompt, False)]
lm_out["beam_tensor_parallel"], lm_out["sample_tensor_parallel"] = [
    np.asarray(t).tolist() for t in searches(nnx.state(placed), prompt, True)]
print("RESULT " + json.dumps({"sharded": sharded, "replicated": replicated, "devices": devices, "lm": lm_out,
                              "beam_split": beam_split, "beam_whole": beam_whole, "top_k": top_k}))
"""


@pytest.mark.slow
def test_eval_decoding_splits_rows_over_the_data_axes_and_decodes_as_replicated(tmp_path):
  """Host arrays made every device of the data axes decode every row; now each decodes its share. And a
  language model placed tensor-parallel (`sharding.place_model`) decodes the tokens of its one-device self."""
  result = helpers.run([sys.executable, "-c", _DECODE_SHARDED, str(tmp_path / "run")], cwd=REPO,
                       env=subprocess_env(device_count=8), timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.split("RESULT ", 1)[1])
  assert out["devices"] == [8, 8, 1, 1]  # rows split over data x fsdp, then the replicated reference
  assert out["sharded"] == out["replicated"] and len(set(out["sharded"])) > 5, out
  lm = out["lm"]
  assert lm["mlp_devices"] == 2 and lm["mlp_shard"] == [2, 32, 32], lm  # half of mlp_dim 64 on each device
  assert lm["tensor_parallel"] == lm["tokens"] and len({t for row in lm["tokens"] for t in row}) > 5, lm
  # Candidates ranked where the vocabulary lies (the tied table split: 31 of its 62 rows a device; the
  # translator's 259 byte ids stay whole, so its beam search above checks the trainer's wiring and the fallback):
  # the same beams and draws as ranked whole.
  assert lm["vocab_shard"] == [31, 32], lm
  assert lm["beam_tensor_parallel"] == lm["beam"] and lm["sample_tensor_parallel"] == lm["sample"], lm
  assert lm["sample"] != lm["tokens"], lm  # top-4 sampling drew other tokens than greedy somewhere
  assert out["beam_split"] == out["beam_whole"] and len(set(out["beam_split"])) > 5, out
  top_k = out["top_k"]
  assert top_k["spec"] == "P(('data', 'fsdp'), 'tensor')" and top_k["equal"] == [True, True], top_k
  assert 40 in top_k["whole_gathers"] and max(top_k["split_gathers"]) < 40, top_k  # 2 shards x 5 candidates


def _config(**fields):
  config = helpers.load_config(f"--config={test_launch.CONFIG}")
  config.update_from_flattened_dict({**OVERRIDES, **fields})
  return config


def test_cpu_devices_counts_one_a_core_as_the_mesh_and_batches_divide():
  """config.cpu_devices = N asks for N devices; 0 for one a core, lowered until the default mesh's data axis
  splits batch_size and eval_batch_size evenly (and each microbatch), or a fixed axis divides the count."""
  assert distributed.cpu_device_count(_config(cpu_devices=3), cores=8) == 3
  assert distributed.cpu_device_count(_config(cpu_devices=0), cores=8) == 8  # batches of 8
  assert distributed.cpu_device_count(_config(cpu_devices=0), cores=3) == 2
  assert distributed.cpu_device_count(_config(cpu_devices=0), cores=1) == 1
  assert distributed.cpu_device_count(_config(cpu_devices=0, eval_batch_size=12), cores=8) == 4
  assert distributed.cpu_device_count(_config(cpu_devices=0, num_microbatches=4), cores=8) == 2  # 2 rows each
  assert distributed.cpu_device_count(_config(cpu_devices=0, **{"mesh.tensor": 4}), cores=6) == 4
  assert distributed.cpu_device_count(_config(cpu_devices=0, **{"mesh.data": 1}), cores=8) == 1  # a fixed mesh
  with pytest.raises(ValueError, match="cores must be >= 1"):
    distributed.cpu_device_count(_config(cpu_devices=0), cores=0)


def test_set_cpu_devices_leaves_a_count_set_by_the_environment_or_a_multi_process_run(monkeypatch, caplog):
  asked = []
  monkeypatch.setattr(distributed.jax.config, "update", lambda name, value: asked.append((name, value)))
  monkeypatch.setattr(distributed.attention_ops, "usable_cores", lambda: 4)
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  assert distributed.set_cpu_devices(_config(cpu_devices=1), multi_process=False) is None
  assert distributed.set_cpu_devices(_config(cpu_devices=0), multi_process=True) is None
  assert asked == []
  assert distributed.set_cpu_devices(_config(cpu_devices=0), multi_process=False) == 4
  assert asked == [("jax_num_cpu_devices", 4)]
  for name, value in (("XLA_FLAGS", "--xla_force_host_platform_device_count=8"), ("JAX_NUM_CPU_DEVICES", "2")):
    monkeypatch.setenv(name, value)
    with caplog.at_level("INFO"):
      assert distributed.set_cpu_devices(_config(cpu_devices=2), multi_process=False) is None
    assert f"cpu_devices=2 not applied: the environment sets the CPU device count ({name}" in caplog.text
    assert distributed.environment_cpu_devices().endswith(value)
  assert asked == [("jax_num_cpu_devices", 4)]


@pytest.mark.slow
def test_cpu_devices_split_each_batch_over_that_many_devices_with_the_single_device_losses(tmp_path, single_device):
  """launch.py gives a run config.cpu_devices CPU devices before JAX starts (here the environment sets no
  count); the default mesh's data axis takes them."""
  env = subprocess_env()
  env["XLA_FLAGS"] = " ".join(flag for flag in env["XLA_FLAGS"].split() if "device_count" not in flag)
  env.pop("JAX_NUM_CPU_DEVICES", None)
  result = helpers.run(launch_args(tmp_path / "run", "--config.cpu_devices=2"), cwd=REPO, env=env, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "mesh data=2 x fsdp=1 x tensor=1 over 2 cpu device(s)" in result.stderr, result.stderr[-3000:]
  losses = train_losses(tmp_path / "run")
  assert sorted(losses) == sorted(single_device)
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [single_device[s] for s in sorted(single_device)], rtol=1e-5, atol=1e-5)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step_and_resumes_exactly(tmp_path, single_device):
  """A scheduler preempting one host: the SIGTERM'd process and its peer agree on the step to stop
  at, save one checkpoint together (a collective) and exit 0; a restart of both completes the run
  with the single-device losses. Before the stop decision was shared, the peer trained on into a
  collective the signalled process never joined and both hung. Every step's loss is logged by two processes
  (the stopped run's, then the restart's) and compared with the single-device run's: the test that two
  processes give the single-device losses."""
  workdir = tmp_path / "run"

  def start_both(step_delay_s):
    address = f"127.0.0.1:{_free_port()}"
    return [start(workdir, f"--coordinator_address={address}", "--num_processes=2", f"--process_id={i}",
                  overrides={"debug.step_delay_s": step_delay_s}, device_count=2) for i in range(2)]

  def finish(processes, timeout):
    try:
      outputs = [p.communicate(timeout=timeout) for p in processes]
    finally:  # a hang must not outlive the test
      for p in processes:
        p.kill()
    for process, (_, stderr) in zip(processes, outputs):
      assert process.returncode == 0, stderr[-3000:]
    return outputs

  processes = start_both(0.5)  # slowed, so the signal arrives mid-run
  wait_for(lambda: (workdir / "metrics.jsonl").exists() and len(metrics_rows(workdir)) >= 2, processes[0])
  processes[1].send_signal(signal.SIGTERM)
  outputs = finish(processes, timeout=120)
  assert "Another process received SIGTERM" in outputs[0][1]
  stopped_at = checkpoint_steps(workdir)
  assert stopped_at and stopped_at[-1] < STEPS

  finish(start_both(0.0), timeout=600)
  losses = train_losses(workdir)
  assert sorted(losses) == sorted(single_device)
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [single_device[s] for s in sorted(single_device)], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_processes_given_different_process_counts_are_stopped_in_one_line(tmp_path):
  """--num_processes=4 on a process whose coordinator runs 2: before, both trained as if all was
  well, with the config checked against 4 processes."""
  address = f"127.0.0.1:{_free_port()}"
  args = [launch_args(tmp_path / "run", f"--coordinator_address={address}", f"--num_processes={n}",
                      f"--process_id={i}", "--distributed_timeout=60") for i, n in ((0, 2), (1, 4))]
  first = helpers.start(args[0], cwd=REPO, env=subprocess_env())
  try:
    second = helpers.run(args[1], cwd=REPO, env=subprocess_env(), timeout=120)
  finally:
    first.kill()
    _, first_stderr = first.communicate(timeout=60)
  assert second.returncode == 2, second.stderr[-3000:]
  assert "--num_processes=4, but the coordinator at" in second.stderr and "started 2 processes" in second.stderr
  assert "Traceback" not in second.stderr
  # Both announced what they wait for, so a process left waiting says why.
  assert f"process 0 of 2: waiting up to 60 s for all 2 processes to connect to {address}" in first_stderr


# What each of two processes is given, and the line both stop with.
_DIFFERENT_RUNS = {
    # before: each compiled its own program; the first finished, the second waited in a collective its peer never
    # joined until it was killed (then a traceback)
    "overrides": ((("run", {"total_steps": 8}), ("run", {"total_steps": 12})),
                  "process 1 was given --config.total_steps=12, process 0 --config.total_steps=8"),
    # before: both trained to the first checkpoint and waited there for ever, each for the other's half of it
    "workdirs": ((("run0", {}), ("run1", {})), "process 1 was given --workdir='{root}/run1', process 0 "
                 "--workdir='{root}/run0'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", _DIFFERENT_RUNS)
def test_processes_given_different_runs_are_stopped_in_one_line(tmp_path, case):
  """Both processes stop before building anything, each with the line naming the first differing field, status 2."""
  given, line = _DIFFERENT_RUNS[case]
  address = f"127.0.0.1:{_free_port()}"
  processes = [helpers.start(launch_args(tmp_path / name, f"--coordinator_address={address}", "--num_processes=2",
                                         f"--process_id={i}", "--distributed_timeout=60", overrides=overrides),
                             cwd=REPO, env=subprocess_env()) for i, (name, overrides) in enumerate(given)]
  try:
    outputs = [p.communicate(timeout=120) for p in processes]
  finally:
    for p in processes:
      p.kill()
  for process, (_, stderr) in zip(processes, outputs):
    assert process.returncode == 2, stderr[-3000:]
    assert "launch.py: " + line.format(root=tmp_path) in stderr and "Traceback" not in stderr, stderr[-3000:]
  assert not any(tmp_path.iterdir())


def test_a_process_whose_peer_never_connects_is_aborted_after_the_distributed_timeout(tmp_path):
  """Process 0 of 2 alone, --distributed_timeout=1: JAX's coordination client aborts it (a fatal error, no
  Python exception) a few seconds later, before it trains or writes anything; without the flag it waits 300 s."""
  address = f"127.0.0.1:{_free_port()}"
  lone = helpers.start(launch_args(tmp_path / "run", f"--coordinator_address={address}", "--num_processes=2",
                                   "--process_id=0", "--distributed_timeout=1"), cwd=REPO, env=subprocess_env())
  try:
    _, stderr = lone.communicate(timeout=30)
  finally:
    lone.kill()
  assert lone.returncode not in (0, 1, 2), stderr[-3000:]  # aborted, not ended by launch.py
  assert f"process 0 of 2: waiting up to 1 s for all 2 processes to connect to {address}" in stderr
  assert not (tmp_path / "run").exists()
