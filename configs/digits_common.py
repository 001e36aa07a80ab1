"""What the three digit-classification configs share: the task, the data and the training schedule."""
from __future__ import annotations

from ml_collections import ConfigDict

from configs import common


def digits_config(*, total_steps: int, learning_rate: float) -> ConfigDict:
  config = common.base_config(total_steps=total_steps, batch_size=64, eval_batch_size=120,  # 360 test = 3 x 120
                              log_every_steps=100, eval_every_steps=1000, checkpoint_every_steps=1000,
                              learning_rate=learning_rate, warmup_steps=100)
  config.task.name = "digits"
  config.task.label_smoothing = 0.0
  config.task.num_attention_images = 4      # data.eval_split images whose query attention is drawn (0 = none)
  config.data = ConfigDict({
      "test_fraction": 0.2,                 # 360 test images, stratified, fixed
      "validation_fraction": 0.1,           # of each class's other images held out: 1,288 train / 149 validation
      "split_seed": 0,
      # the split eval reads (digits.EVAL_SPLITS): validation while training (what checkpoint.best_metric and
      # early stopping read); test for the final score: launch.py --mode=eval --config.data.eval_split=test
      "eval_split": "validation",
      "grid": "8x8",                        # the grid images are trained and evaluated on
      "extra_eval_grids": "12x12,16x16",    # also evaluated on test images resized to these
      "max_shift": 1,                       # random translation by up to this many pixels in training (<= 3)
  })
  config.checkpoint.best_metric = "eval/accuracy"
  config.checkpoint.best_mode = "max"
  config.optimizer.b2 = 0.99
  config.optimizer.eps = 1e-8
  config.optimizer.weight_decay = 0.05
  return config
