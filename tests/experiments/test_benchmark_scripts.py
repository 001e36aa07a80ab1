"""The benchmark scripts: a bad argument stops a script before it measures anything, and a run reaches its
results files (a broken writer costs a full run's minutes, found only at its end)."""
import importlib
import json
import pathlib
import sys

import pytest

from tests import helpers

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[2] / "experiments"


def _run(script, *args):
  return helpers.run([sys.executable, str(EXPERIMENTS / script), *args], timeout=120)


@pytest.mark.parametrize("script", ["bench_attention.py", "bench_latent_reader.py", "bench_translator.py",
                                    "bench_matmul_shapes.py", "bench_lm.py", "bench_segment.py",
                                    "compare_connectors.py", "vlm_lm_skills.py", "bench_backward_blocks.py"])
def test_an_output_directory_that_cannot_be_made_fails_before_measuring(script, tmp_path):
  """It was made after the measurements: minutes of a full run lost to a typo in --out."""
  (tmp_path / "a_file").write_text("")
  result = _run(script, "--quick", f"--out={tmp_path / 'a_file' / 'results'}")
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].endswith("a_file/results: Not a directory")
  assert "{" not in result.stdout  # no measured row printed


def test_an_output_directory_under_home_is_made_there(tmp_path, monkeypatch):
  """--out=~/results made a folder named ~ in the current one (the shell leaves a ~ after "=")."""
  sys.path.insert(0, str(EXPERIMENTS))
  try:
    import bench_common
  finally:
    sys.path.remove(str(EXPERIMENTS))
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  out = bench_common.output_dir(type("Args", (), {"out": "~/results", "quick": False})(), "bench")
  assert out == tmp_path / "home" / "results" and out.is_dir() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("args, message", [
    (["--repeats=0"], "--repeats must be >= 1, got 0"),  # wrote NaN tables, status 0
    (["--one=foo"], "--one must be reader:SIDE or encoder:SIDE, got 'foo'"),
    (["--render=/no/such.json"], "--render /no/such.json: no such results file"),
])
def test_latent_reader_benchmark_refuses_bad_arguments_in_one_line(args, message):
  result = _run("bench_latent_reader.py", *args)
  assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(message), result.stderr[-2000:]


def test_latent_reader_results_record_commit_date_load_before_and_command(tmp_path, monkeypatch):
  """Its table had the load at the end alone, where README promises every results file the run's provenance."""
  monkeypatch.syspath_prepend(str(EXPERIMENTS))
  bench = importlib.import_module("bench_latent_reader")
  rows = [{"model": model, "side": 8, "M": 64, "N": 32, "forward_ms": 1.0, "runs": 2, "peak_rss_growth_mb": 1.5,
           "xla_temp_mb": 0.5} for model in ("reader", "encoder")]
  run = {"commit": "0123456789abcdef", "dirty": False, "date": "2026-12-07 18:00 UTC", "load_average_before": 0.25,
         "command": "python experiments/bench_latent_reader.py --quick"}
  bench.write_results(rows, str(tmp_path / "r"), 2, {"cpu_cores": 2, "load_average_1min": 1.0, "provenance": run})
  text = (tmp_path / "r.md").read_text()
  assert ("Commit `0123456`, 2026-12-07 18:00 UTC, `python experiments/bench_latent_reader.py --quick`; 1-minute "
          "load average 0.2 before the start.") in text
  assert json.loads((tmp_path / "r.json").read_text())["machine"]["provenance"] == run


@pytest.mark.parametrize("script, results", [("compare_connectors", "compare_connectors"),
                                             ("vlm_lm_skills", "intel_xeon_amx/vlm_lm_skills_test")])
def test_results_files_give_their_run_in_bench_commons_one_sentence(script, results):
  """Eight scripts each spelled the commit, date, command and load sentence themselves, in five wordings."""
  from experiments import bench_common
  module = importlib.import_module(f"experiments.{script}")
  record = json.loads((EXPERIMENTS / "results" / f"{results}.json").read_text())
  line = bench_common.provenance_line(record["provenance"], 10)
  assert line.startswith(f"Commit `{record['provenance']['commit'][:10]}") and line.endswith("before the start.")
  assert line in module.render(record)


@pytest.fixture(scope="module")
def torch_translator():
  """bench_translator's torch model at its --quick sizes, its cached decoder, and a batch of sources."""
  import importlib
  import numpy as np
  import torch
  sys.path.insert(0, str(EXPERIMENTS))
  try:
    bench = importlib.import_module("bench_translator")
  finally:
    sys.path.remove(str(EXPERIMENTS))
  sizes = dict(bench.QUICK, vocab=50)  # a small vocabulary: few near-ties left to rounding
  torch.manual_seed(0)
  model = bench.TorchTranslator(sizes).eval()
  inputs = torch.from_numpy(bench.tokens(np.random.default_rng(0), sizes["vocab"], sizes["batch"], sizes["length"]))
  return bench, sizes, model, bench.TorchCachedDecoder(model, sizes["new_tokens"]), inputs.long()


def test_cached_torch_decoder_decodes_what_the_rerunning_decoder_decodes(torch_translator):
  bench, sizes, model, cached, inputs = torch_translator
  rerun = bench.torch_greedy_rerun(model, sizes["new_tokens"])(inputs)
  assert rerun.shape == (sizes["batch"], sizes["new_tokens"])
  assert bool((bench.torch_greedy_cached(cached, sizes["new_tokens"])(inputs) == rerun).all())


def test_cached_torch_beam_search_of_one_beam_without_penalty_is_greedy(torch_translator):
  bench, sizes, _, cached, inputs = torch_translator
  greedy = bench.torch_greedy_cached(cached, sizes["new_tokens"])(inputs)
  beam = bench.torch_beam_cached(cached, sizes["new_tokens"], beam_size=1, alpha=0.0, eos_id=sizes["vocab"])(inputs)
  assert bool((beam == greedy).all())


def test_a_partial_translator_run_keeps_the_other_sections_of_the_file_it_rewrites(torch_translator, tmp_path):
  bench = torch_translator[0]
  runs = lambda sections, commit: [{"sections": sections, "commit": commit}]  # noqa: E731
  previous = {"machine": {"runs": runs("training,decoding,compile", "old")}, "training": {"jax": 1.0},
              "training_flops": {"f": 2}, "decoding": {"jax": "old"}, "decode_limit": {"l": 1},
              "compile_s": {"c": 3}, "step_s_at_benchmark_depth": {"s": 4}}
  (tmp_path / "translator_benchmark.json").write_text(bench.json.dumps(previous))
  new = {"machine": {"runs": runs("decoding", "new")}, "decoding": {"jax": "new"}, "torch_compile": "ok",
         "decode_limit": {"l": 2}}
  merged = bench.keep_other_sections(tmp_path / "translator_benchmark.json", new, ("decoding",))
  assert merged["decoding"] == {"jax": "new"} and merged["decode_limit"] == {"l": 2}
  assert merged["training"] == {"jax": 1.0} and merged["compile_s"] == {"c": 3}
  assert [r["commit"] for r in merged["machine"]["runs"]] == ["old", "new"]
  assert bench.keep_other_sections(tmp_path / "translator_benchmark.json", new, bench.SECTIONS) is new


@pytest.mark.parametrize("script, stem", [("bench_matmul_shapes.py", "matmul_shapes"),
                                          ("bench_segment.py", "segment_benchmark"),
                                          ("bench_backward_blocks.py", "attention_backward_blocks")])
def test_a_quick_run_writes_its_tables_and_provenance(script, stem, tmp_path):
  """The benchmarks quick enough to run whole here (seconds at --quick); the others' writers are below."""
  result = _run(script, "--quick", f"--out={tmp_path}")
  assert result.returncode == 0, result.stderr[-2000:]
  record = json.loads((tmp_path / f"{stem}.json").read_text())
  markdown = (tmp_path / f"{stem}.md").read_text()
  assert record["rows"] and "| --- |" in markdown
  run = record["provenance"]
  assert script in run["command"] and "--quick" in run["command"] and run["commit"][:7] in markdown


@pytest.mark.parametrize("script, results", [("bench_lm", "intel_xeon_amx/lm_benchmark"),
                                             ("bench_translator", "intel_xeon_amx/translator_benchmark")])
def test_the_renderer_rewrites_the_table_of_a_full_run_from_its_record(script, results):
  """A full run takes minutes, its --quick run most of a minute: the renderer is checked on a real record
  instead, the newest this code wrote, against the table the run printed."""
  sys.path.insert(0, str(EXPERIMENTS))
  try:
    bench = importlib.import_module(script)
  finally:
    sys.path.remove(str(EXPERIMENTS))
  path = EXPERIMENTS / "results" / results
  markdown = bench.render(json.loads(path.with_suffix(".json").read_text()))
  assert markdown == path.with_suffix(".md").read_text()
