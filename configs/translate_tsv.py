"""The translator on a user's parallel corpus: UTF-8 lines of "source<TAB>target".

    python launch.py --config=configs/translate_tsv.py --workdir=workdirs/my_corpus \
        --config.data.train_file=train.tsv --config.data.eval_file=eval.tsv

A malformed line (no tab, several tabs, an empty side), a file that is not UTF-8, or a missing or
empty file stops the run before training, naming the file and line (exit status 2).
"""
from __future__ import annotations

from configs import common, translate_dates


def get_config(arg=None):
  args = common.parse_arg(arg, size="tiny", posenc="sinusoidal", tokenizer="sentencepiece", scan=False)
  config = translate_dates.translator_config(args)
  config.data.source = "tsv"
  config.data.vocab_size = 4000  # a real corpus wants more pieces than dates do; a smaller one gets what it
  #                                supports (data.vocab_size_exact=False)
  config.model.max_length = 256
  return config
