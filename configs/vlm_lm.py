"""The vision-language models' frozen language model: the decoder-only LM pretrained on the VLM's text alone.

    python launch.py --config=configs/vlm_lm.py --workdir=workdirs/vlm_lm

Its documents are the texts of the "train" examples of data.vlm_digits (data.source="vlm_digits"), each twice:
with "<image>" where an image sits and no image, so the LM learns the language (the questions, digits as words,
number words) but cannot know the answers; and with each image described in words before its marker
(data.describe_images), so the LM learns to answer from a description: copy, count, index, add, compare. A
connector can then use that skill by making the image read like its description, as the LM inside a
real vision-language model brings what it learned from text. Eval: the texts of "test" examples (held-out
digit sequences), in the same two forms.
SentencePiece keeps "<image>" one piece (data.single_piece_words), so the VLM task can encode each text
segment alone and splice image tokens in between.
"""
from __future__ import annotations

from configs import common, lm_text


def get_config(arg=None):
  # describe=false, steps=600: the LM on marker-only texts that the connectors read before (no skills to lend)
  # layers=L: L blocks instead of the size's (0); layers=4,steps=4000 answers better from words but is much
  # harder for a connector to steer (experiments/results/amd_epyc_avx512/vlm_connector_levers.md)
  args = common.parse_arg(arg, steps=2000, size="tiny", posenc="rope", describe=True, layers=0)
  config = lm_text.get_config(f"size={args.size},posenc={args.posenc},tokenizer=sentencepiece")
  config.total_steps = args.steps
  if args.layers:
    config.model.num_layers = args.layers
  config.optimizer.warmup_steps = 50
  config.eval_every_steps = 300
  config.checkpoint.every_steps = 300
  config.data.source = "vlm_digits"     # data.vlm_digits.lm_corpus
  config.data.num_train_documents = 40000 if args.describe else 20000  # 20,000 examples (each twice, described)
  config.data.num_eval_documents = 1000
  config.data.max_digits = 4
  config.data.corpus_seed = 0
  config.data.describe_images = args.describe  # each text also with its images described in words (lm_corpus)
  config.data.vocab_size = 128          # a cap: every one of the texts' 39 words is one piece
  config.data.single_piece_words = ("<image>",)
  config.data.sequence_length = 64
  config.task.decoding.method = "greedy"
  config.task.decoding.max_new_tokens = 16
  return config
