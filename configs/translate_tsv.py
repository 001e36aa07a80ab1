"""The translator on a user's parallel corpus: UTF-8 lines of "source<TAB>target".

    python launch.py --config=configs/translate_tsv.py --workdir=workdirs/my_corpus \
        --config.data.train_file=train.tsv [--config.data.eval_file=eval.tsv]

Without an eval file, 5% of the training file's sources (data.eval_fraction; every pair of a held-out source)
are held out for eval by a stable hash of the source; --mode=eval holds out the same ones.

Training ends after `epochs=20` passes over the pairs if that comes before total_steps (10,000), but not before
`min_steps=1200` (the dates' budget): a corpus under ~3,800 pairs (60 steps a pass) trains 1,200 steps, a larger
one up to 20 passes, 10,000 steps from ~32,000 pairs on; `epochs=0` trains total_steps (10,000) whatever the
corpus.

Each eval while training scores the loss on every eval pair and decodes (exact match, BLEU, chrF) 1,000 of them,
evenly spaced through the file (task.num_decode_examples; 0 = all); --mode=eval decodes every pair.

A malformed line (no tab, several tabs, an empty side), a file that is not UTF-8, or a missing or
empty file stops the run before training, naming the file and line (exit status 2).
"""
from __future__ import annotations

from configs import common, translate_dates


def get_config(arg=None):
  args = common.parse_arg(arg, size="tiny", posenc="sinusoidal", tokenizer="sentencepiece", scan=False,
                          epochs=20.0, min_steps=1200)
  config = translate_dates.translator_config(args)
  # A corpus's size is the user's: 1,200 steps of 64 pairs are a fraction of a pass over 100,000 pairs (on a
  # synthetic 20,000: BLEU 72 after 1,200 steps, 94 after 20 passes; experiments/results/intel_xeon_amx/
  # translator_tsv_budget.md).
  config.total_steps = 10000
  config.max_epochs = args.epochs
  config.min_steps = args.min_steps
  config.data.source = "tsv"
  config.data.eval_fraction = 0.05  # of the sources, held out when there is no data.eval_file
  config.data.vocab_size = 4000  # a real corpus wants more pieces than dates do; a smaller one gets what it
  #                                supports (data.vocab_size_exact=False)
  config.model.max_length = 256
  # Each eval in training decodes 1,000 eval pairs, evenly spaced through the file (all of a smaller file): greedy
  # decoding of a 5,000-pair file took 45 s an eval, the time of ~640 training steps of the tiny model, 25 times a
  # 10,000-step run. --mode=eval, the final score, decodes every pair.
  config.task.num_decode_examples = 1000
  return config
