"""The vision-language models' frozen language model: the decoder-only LM pretrained on the VLM's text alone.

    python launch.py --config=configs/vlm_lm.py --workdir=workdirs/vlm_lm

Its documents are the texts of the "train" examples of data.vlm_digits (data.source="vlm_digits"), each twice:
with "<image>" where an image sits and no image, so the LM learns the language (the questions, digits as words,
number words) but cannot know the answers; and with each image described in words before its marker
(data.describe_images), so the LM learns to answer from a description: copy, count, index, add, compare. A
connector can then use that skill by making the image read like its description, as the LM inside a
real vision-language model brings what it learned from text. Eval: the texts of "validation" examples
(held-out digit sequences), in the same two forms; the LM never reads a test text.
SentencePiece keeps "<image>" one piece (data.single_piece_words), so the VLM task can encode each text
segment alone and splice image tokens in between.

`text=pairs` (configs/vlm_tsv.py's LM): the text of a user's `image_path<TAB>text` pairs instead, each line
"<image> text" (data.file_format="image_text"), so the LM can write the user's words; the VLM task names its
own data.train_file and data.eval_file here (only their text is read: the LM never sees the eval captions in
training), and the tokenizer takes as many pieces as the captions support, up to lm_text's cap.
Either text is trained for at most `epochs=50` passes (config.max_epochs, as lm_text counts them), at least `min_steps=300`
steps, at most `steps`: a user's captions are sized by their count (on 2,000 shape captions, 125 rows, the eval
loss levels off by step ~300, where 2,000 steps took 5 minutes:
experiments/results/intel_xeon_amx/vlm_pairs_lm_budget.md); the bundled texts (194 steps a pass) run `steps`.
`steps` defaults to the text's DEFAULT_STEPS: the bundled texts' 4,000 were chosen on the validation split (the
2-block LM answers from words 0.897 there against 0.829 at 2,000 steps, the sum 0.92 against 0.75, and a
Q-Former reading it 0.938 against 0.889: experiments/results/intel_xeon_amx/vlm_lm_4000_steps.md).
"""
from __future__ import annotations

from configs import common, lm_text

TEXTS = ("digits", "pairs")  # what the LM pretrains on: the bundled strips' texts, or a user's captions
DEFAULT_STEPS = {"digits": 4000, "pairs": 2000}  # `steps` when the config names none (pairs: a cap, see above)


def get_config(arg=None):
  # describe=false, steps=600: the LM on marker-only texts that the connectors read before (no skills to lend)
  # layers=L: L blocks instead of the size's (0); layers=4,steps=4000 answers better from words but is much
  # harder for a connector to steer (experiments/results/amd_epyc_avx512/vlm_connector_levers.md); so is the
  # LM trained on examples=80000 (4x the texts), although it sums better from words
  args = common.parse_arg(arg, steps=0, size="tiny", posenc="rope", describe=True, layers=0, examples=20000,
                          text="digits", epochs=50.0, min_steps=300)
  if args.text not in TEXTS:
    raise ValueError(f"text must be one of {TEXTS}, got {args.text!r}")
  args.steps = args.steps or DEFAULT_STEPS[args.text]
  config = lm_text.get_config(f"size={args.size},posenc={args.posenc},tokenizer=sentencepiece,epochs={args.epochs},"
                              f"min_steps={args.min_steps}")
  config.total_steps = args.steps
  if args.layers:
    config.model.num_layers = args.layers
  config.optimizer.warmup_steps = 50
  config.eval_every_steps = 300
  config.checkpoint.every_steps = 300
  # One CPU device a core (common.base_config's cpu_devices): in the VLM chain this LM trains side by side with
  # the image encoder, which ends first and keeps one device; the LM's devices then use the core it leaves idle.
  config.cpu_devices = 0
  # No best checkpoint: eval/loss is lowest at step ~600 and rises after, on the marker-only texts' answers the
  # LM cannot know, while its answers from words improve to the end (experiments/results/intel_xeon_amx/
  # vlm_lm_4000_steps.md); a "best" by it would be the wrong LM. The last step is the LM a connector reads.
  config.checkpoint.best_metric = ""
  config.data.single_piece_words = ("<image>",)
  config.task.decoding.method = "greedy"
  config.task.decoding.max_new_tokens = 16
  config.task.num_samples_logged = 0  # no samples: its evals stay as short as the VLM chain's time budget had them
  if args.text == "pairs":
    config.data.file_format = "image_text"  # "<image> text" of each pair; the VLM task sets the files
    config.data.sequence_length = 128
    return config
  config.data.source = "vlm_digits"     # data.vlm_digits.lm_corpus
  config.data.num_train_documents = args.examples * (2 if args.describe else 1)  # described: each example twice
  config.data.num_eval_documents = 1000
  config.data.max_digits = 4
  config.data.corpus_seed = 0
  config.data.describe_images = args.describe  # each text also with its images described in words (lm_corpus)
  config.data.vocab_size = 128          # a cap: every one of the texts' 39 words is one piece
  config.data.sequence_length = 64
  return config
