"""The VLM attention figure: the Q-Former's maps drawn for a model on the tiny chain's frozen parts."""
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import vlm_attention_maps
from tests import helpers
from tests.tasks.test_vlm import TINY_CHAIN, tiny_chain
from xattn_jax.tasks.vlm import plots
from xattn_jax.training import task as task_lib


def test_the_qformer_figure_draws_one_map_per_query_for_each_example(tmp_path):
  chain = tiny_chain()
  overrides = {**TINY_CHAIN, "model.encoder_workdir": chain / "encoder", "model.lm_workdir": chain / "lm",
               "model.num_queries": 4, "data.num_eval_examples": 8}
  config = helpers.load_config("--config=configs/vlm_digits.py:connector=qformer",
                               *(f"--config.{k}={v}" for k, v in overrides.items()))
  task = task_lib.get_task_class(config.task.name)(config, str(tmp_path / "run"), "train")
  model = task.make_model(nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  examples = vlm_attention_maps.pick_examples(task.eval_examples, 2)
  assert sorted(e.num_digits for e in examples) == [1, 2]  # one example per digit count
  drawn = plots.attention_figure(task, model, examples, str(tmp_path / "maps.png"))
  assert (tmp_path / "maps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for (image, _, _, panels), example in zip(drawn, examples):
    assert len(panels) == 4
    grid = (image.shape[0] // task.patch_size, image.shape[1] // task.patch_size)
    for _, grid_map in panels:  # probabilities over the canvas: the image's share of them
      assert grid_map.shape == grid and np.all(grid_map >= 0) and grid_map.sum() <= 1 + 1e-5


def test_a_caption_in_a_script_no_font_draws_warns_of_no_missing_glyph(tmp_path, monkeypatch):
  """A user's Chinese captions (configs/vlm_tsv.py) on a machine without a CJK font: the titles read \\uXXXX
  (drawn as is where a font has the characters), never one matplotlib "Glyph ... missing" warning per distinct
  character, which flooded the log and drew empty boxes. A '$' is text: '$^$' raised mathtext's
  ParseSyntaxException at savefig."""
  import types
  import warnings
  grid = np.full((2, 4), 1 / 8)
  monkeypatch.setattr(plots, "example_maps", lambda task, model, example: (
      np.zeros((8, 16)), "描述这张图片 $^$", "一只猫 مرحبا $5 $x$", [("'猫' (cls 5%)", grid), ("'$^$' (cls 3%)", grid)]))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plots.attention_figure(types.SimpleNamespace(patch_size=4), None, [None], str(tmp_path / "maps.png"))
  assert (tmp_path / "maps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert [str(w.message) for w in caught if "missing from" in str(w.message)] == []
