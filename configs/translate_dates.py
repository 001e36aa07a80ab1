"""The default job: the encoder-decoder translator on bundled English -> French CLDR dates.

    python launch.py --config=configs/translate_dates.py --workdir=workdirs/dates
    python launch.py --config=configs/translate_dates.py:size=base,locale=de --workdir=workdirs/dates_de
    python launch.py --config=configs/translate_dates.py --workdir=workdirs/dates \
        --config.model.position_encoding=rope
    echo "Sunday, November 29, 2026" | python launch.py --config=configs/translate_dates.py \
        --workdir=workdirs/dates --mode=infer --config.task.decoding.method=beam --config.task.decoding.beam_size=4
    echo "Sunday, November 29, 2026" | python launch.py --config=configs/translate_dates.py \
        --workdir=workdirs/dates --mode=infer

`tiny` (the default) reaches eval exact match >= 0.99 in a few minutes on 2 CPU cores; `base` is
the 6+6-layer, d_model 512 model of Vaswani et al.
"""
from __future__ import annotations

from ml_collections import ConfigDict

from configs import common

# name: (d_model, num_heads, num_layers, mlp_dim) of both the encoder and the decoder
SIZES = {
    "tiny": (128, 4, 2, 256),
    "base": (512, 8, 6, 2048),
}


def translator_config(args) -> ConfigDict:
  """Everything but the data: shared with configs/translate_tsv.py."""
  if args.size not in SIZES:
    raise ValueError(f"config argument size={args.size!r}: allowed sizes are {sorted(SIZES)}")
  # Measured on 2 CPU cores: exact match 1.0 on held-out dates from the first eval (step 400, tiny,
  # sentencepiece); 1200 steps (under 1.5 minutes idle, 4 minutes loaded) leave margin.
  config = common.base_config(total_steps=1200, batch_size=64, eval_batch_size=256, log_every_steps=100,
                              eval_every_steps=400, checkpoint_every_steps=400, learning_rate=2e-3,
                              warmup_steps=100)
  config.checkpoint.best_metric = "eval/exact_match"
  config.checkpoint.best_mode = "max"

  config.task.name = "translate"
  config.task.label_smoothing = 0.1
  # How eval and infer decode (tasks/decoding_config.py): greedy | beam (beam_size, alpha: GNMT length
  # penalty) | sample (temperature, top_k: 0 = all, top_p: 1 = no nucleus cut, seed); cache_halves: a cache of
  # 64+ positions decodes its first half on that half alone (faster; 1.5x the cache's memory meanwhile).
  config.task.decoding = ConfigDict({"method": "greedy", "beam_size": 4, "alpha": 0.6, "temperature": 1.0,
                                     "top_k": 0, "top_p": 1.0, "seed": 0, "cache_halves": True})
  config.task.max_decode_length = 0    # 0 = model.max_length (decoding stops at EOS anyway)
  config.task.num_decode_examples = 0  # eval sentences decoded for exact match / BLEU / chrF; 0 = all
  config.task.bleu_tokenize = "auto"   # sacrebleu tokenizer, one of tasks/translate/bleu.BLEU_TOKENIZERS; auto:
  #                                      "char" for zh / ja / th ... targets and ones mostly under 4 words, else "13a"
  config.task.num_samples_logged = 3
  config.task.num_attention_plots = 3  # cross-attention PNGs written at each eval (0 = none)
  config.task.attention_per_head = False

  d_model, num_heads, num_layers, mlp_dim = SIZES[args.size]
  side = dict(d_model=d_model, num_heads=num_heads, num_layers=num_layers, mlp_dim=mlp_dim)
  config.model.name = "translator"
  config.model.encoder = ConfigDict(side)  # the two sides may be given different sizes
  config.model.decoder = ConfigDict(side)
  config.model.position_encoding = args.posenc  # xattn_jax.models.translator.position_encodings()
  config.model.max_length = 64 if args.size == "tiny" else 256
  config.model.rope_scaling = ""        # "" or ops.positions.ROPE_SCALINGS: RoPE length scaling (rope)
  config.model.rope_scaling_factor = 1.0
  # Randomized positions (Ruoss et al. 2023): 0 = off, else training draws each sequence's positions from
  # [0, randomized_positions_max) (>= max_length; unpacked rows only).
  config.model.randomized_positions_max = 0
  config.model.randomized_positions_at_eval = False  # evaluation and decoding: 0..n-1 (True: drawn)
  config.model.share_embeddings = True  # one table for source and target (one shared vocabulary)
  config.model.tie_output = True        # output projection = transposed target embedding
  config.model.norm = "pre"             # layers.blocks.NORM_PLACEMENTS; post = Vaswani et al.
  config.model.activation = "relu"      # layers.blocks.ACTIVATIONS
  config.model.dropout_rate = 0.0 if args.size == "tiny" else 0.1
  config.model.attention_dropout_rate = 0.0
  config.model.scan_layers = args.scan
  # layers.layer_stack.REMAT_POLICIES. With scan_layers, dots_no_batch: a scan zero-fills and copies
  # every saved activation through [layers, ...] stacks, and saving only the projections' outputs
  # shrinks those (d512 3+3 layers on CPU: scanned step 1.03-1.04x of unrolled, against 1.08-1.11x
  # without remat; unrolled, the same policy costs nothing).
  config.model.remat = "dots_no_batch" if args.scan else "none"
  config.model.implementation = ""      # ops.attention.IMPLEMENTATIONS; "" = the op's default

  config.data = ConfigDict({
      "source": "dates",
      "target_locale": "fr",
      "formats": "full,long,medium",
      "first_year": 1900,
      "last_year": 2099,
      "eval_fraction": 0.01,
      "split_seed": 0,
      "train_file": "",
      "eval_file": "",
      "tokenizer": args.tokenizer,      # sentencepiece | bytes
      "vocab_size": 512,                # sentencepiece only: the most pieces (see vocab_size_exact)
      "vocab_size_exact": False,        # False: as many pieces as the corpus supports, up to vocab_size;
      #                                   True: exactly vocab_size, or the run stops saying the most there can be
      "max_source_length": 0,           # 0 = the longest training example, rounded up to 8
      "max_target_length": 0,
      "length_bucketing": False,
      "packing": False,
  })
  return config


def get_config(arg=None):
  args = common.parse_arg(arg, size="tiny", posenc="sinusoidal", tokenizer="sentencepiece", locale="fr",
                          scan=False)
  config = translator_config(args)
  config.data.target_locale = args.locale
  # A share of the dates held out for the final score, beside data.eval_fraction's (validation): evals during
  # training read validation (data.eval_split, what checkpoint.best_metric and early stopping read); the test
  # score is launch.py --mode=eval --config.data.eval_split=test (splits.EVAL_SPLITS)
  config.data.test_fraction = 0.01
  config.data.eval_split = "validation"
  return config
