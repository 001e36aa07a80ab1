"""A frozen language model captions a user's images: `image_path<TAB>text` pairs (task "vlm", data.source=tsv).

    python launch.py --config=configs/vlm_tsv.py:connector=llava --workdir=workdirs/vlm_pairs \
        --config.data.train_file=pairs.tsv --config.data.eval_file=pairs_eval.tsv

Image paths are relative to the file's folder; PNG / JPEG are read grey and fitted into the frozen encoder's
canvas (data.image_text). A missing or unreadable image, a line without a tab or an empty side stops the run
before anything is written, naming file and line. The frozen LM is pretrained first on the text of the
training pairs (configs/vlm_lm.py:text=pairs, in model.lm_workdir, workdirs/vlm_pairs_lm by default; another
pairs file needs another LM workdir), so it writes your captions' words; the frozen image encoder is the
digits' one of configs/vlm_digits.py (trained on digit strips: your images are read in its grey canvas).
"""
from __future__ import annotations

from configs import common
from configs.vlm_digits import connector_defaults, vlm_config


def get_config(arg=None):
  args = common.parse_arg(arg, steps=1000, lr=0.0, connector="llava", positions="sequence", merge=1, queries=32,
                          latents=32, kinds="caption", scale=1, encoder="", lm="workdirs/vlm_pairs_lm",
                          bucketing=True, cache=True)
  connector_defaults(args)  # lr=0: the connector's DEFAULT_LR
  config = vlm_config(args)
  config.model.lm_config = "configs/vlm_lm.py:text=pairs"  # the VLM task names the pairs files there
  config.task.decoding.max_new_tokens = 32  # infer's limit (eval generates as long as its longest caption)
  config.data.source = "tsv"
  config.data.train_file = ""   # required: --config.data.train_file=pairs.tsv
  config.data.eval_file = ""    # required: --config.data.eval_file=...
  return config
