"""Exact resume rests on each task's training batches being a function of the step alone: a resumed process
asks for step k first and must get what an unbroken run got at step k."""
import jax
import numpy as np
import pytest

from tests import helpers
from xattn_jax.training import task as task_lib

# Every bundled config whose task builds without another run first (the VLM and Q-Former read frozen runs).
CONFIGS = ["configs/template.py", "configs/algorithmic.py", "configs/lm_algorithmic.py",
           "configs/translate_dates.py", "configs/lm_text.py", "configs/perceiver_digits.py",
           "configs/vit_digits.py", "configs/segment_digits.py", "configs/vlm_encoder.py", "configs/vlm_lm.py"]


# The dates of two years, not two centuries: generating and tokenizing those took ~9 s, and the batches are read
# by the same code either way.
SMALLER_DATA = {"configs/translate_dates.py": ("--config.data.first_year=2000", "--config.data.last_year=2001")}


def _task(config_file, workdir):
  config = helpers.load_config(f"--config={config_file}", "--config.batch_size=4", *SMALLER_DATA.get(config_file, ()))
  return task_lib.get_task_class(config.task.name)(config, str(workdir), "train")


@pytest.mark.parametrize("config_file", CONFIGS)
def test_a_step_s_batch_is_the_same_whether_the_steps_before_it_were_read_or_not(config_file, tmp_path):
  unbroken = _task(config_file, tmp_path)
  before = [unbroken.train_batch(step, process_index=0, process_count=1) for step in range(3)]
  resumed = _task(config_file, tmp_path)  # a new process, reading the workdir the first one wrote (its tokenizer)
  for step in (2, 0):
    jax.tree.map(np.testing.assert_array_equal, resumed.train_batch(step, process_index=0, process_count=1),
                 before[step])
  later = unbroken.train_batch(57, process_index=0, process_count=1)
  jax.tree.map(np.testing.assert_array_equal, resumed.train_batch(57, process_index=0, process_count=1), later)
