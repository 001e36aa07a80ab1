"""A decoder-only language model on the bundled corpus (CLDR text, number words) or your own text file.

    python launch.py --config=configs/lm_text.py --workdir=workdirs/lm
    python launch.py --config=configs/lm_text.py:size=small,posenc=alibi,tokenizer=bytes --workdir=workdirs/lm_b
    python launch.py --config=configs/lm_text.py --workdir=workdirs/my_lm --config.data.train_file=my_text.txt
    echo "4,213 is" | python launch.py --config=configs/lm_text.py --workdir=workdirs/lm --mode=infer \
        --config.task.decoding.method=sample --config.task.decoding.temperature=0.8 --config.task.decoding.top_p=0.9
    yes '' | head -n 4 | python launch.py --config=configs/lm_text.py --workdir=workdirs/lm --mode=infer   # from nothing

One document per line (UTF-8). Documents are packed into rows of data.sequence_length tokens. Training stops
after `epochs=12` passes over them if that comes before total_steps (2,000), but not before `min_steps=300`;
`epochs=0` trains total_steps whatever the text's size.
"""
from __future__ import annotations

from ml_collections import ConfigDict

from configs import common

SIZES = {
    # d_model, num_heads, num_layers, mlp_dim
    "micro": (32, 2, 1, 64),   # smoke tests only
    "tiny": (128, 4, 2, 512),
    "small": (256, 8, 4, 1024),
}


def get_config(arg=None):
  args = common.parse_arg(arg, size="tiny", posenc="rope", tokenizer="sentencepiece", epochs=12.0, min_steps=300)
  if args.size not in SIZES:
    raise ValueError(f"config argument size={args.size!r}: allowed sizes are {sorted(SIZES)}")
  config = common.base_config(total_steps=2000, batch_size=32, eval_batch_size=64, log_every_steps=100,
                              eval_every_steps=500, checkpoint_every_steps=500, learning_rate=2e-3,
                              warmup_steps=100)
  # A text file's size is the user's: at most `epochs` passes over its packed rows (at least min_steps updates,
  # at most total_steps), so a small file is not trained 2,000 steps into overfitting. The bundled corpus
  # (78 steps a pass) trains 936 steps: at 2,000 its eval loss rose from step 500 on
  # (experiments/results/intel_xeon_amx/lm_text_budget.md; vlm_pairs_lm_budget.md for a small file).
  config.max_epochs = args.epochs
  config.min_steps = args.min_steps

  config.task.name = "lm"
  config.task.decoding = ConfigDict({
      "method": "sample",     # greedy | sample | beam (decoding.DecodingOptions checks every option)
      "temperature": 0.8,
      "top_k": 0,             # 0 = every token
      "top_p": 0.95,          # 1 = no nucleus cut
      "beam_size": 4,
      "alpha": 0.6,           # beam length-penalty exponent
      "max_new_tokens": 48,
      "seed": 0,              # sampling keys, one per input line
      "cache_halves": True,   # a cache's first half decodes on that half alone (1.5x its memory meanwhile)
  })
  config.task.num_samples_logged = 3  # each eval logs the continuations of this many eval documents' first halves

  config.data = ConfigDict()
  config.data.train_file = ""       # "" = the bundled corpus; else one document per line
  config.data.eval_file = ""        # "" = held out of the training documents (data.eval_fraction)
  config.data.eval_fraction = 0.05
  config.data.num_eval_documents = 0  # the first this many eval documents (0 = all)
  config.data.max_eval_rows = 2048    # packed rows an eval in training scores (0 = all): a large file's held-out 5%
  #                                     would cost minutes an eval; 2048 x 128 tokens (the bundled corpus: 135
  #                                     rows); --mode=eval, the final score, scores every row
  config.data.corpus_seed = 0       # the bundled corpus's generator, and the held-out split
  config.data.tokenizer = args.tokenizer  # sentencepiece | bytes
  config.data.vocab_size = 1024     # sentencepiece: at most this many pieces ...
  config.data.vocab_size_exact = False  # ... or exactly this many (an error if the text cannot give them)
  config.data.sequence_length = 128
  # Eval of a document longer than a row: a sliding window, each chunk after the first reading this many tokens
  # before the ones it scores (half the row unless set; 0 = the training chunks, each without context).
  config.data.eval_context = config.data.get_ref("sequence_length") // 2

  d_model, num_heads, num_layers, mlp_dim = SIZES[args.size]
  config.model.name = "lm"
  config.model.d_model = d_model
  config.model.num_heads = num_heads
  config.model.num_kv_heads = 0     # 0 = num_heads; fewer = grouped-query attention
  config.model.num_layers = num_layers
  config.model.mlp_dim = mlp_dim
  config.model.max_length = 256     # the context: BOS, prompt and new tokens (infer keeps a long prompt's end)
  config.model.position_encoding = args.posenc  # one of xattn_jax.models.lm.position_encodings()
  config.model.rope_scaling = ""    # "" | linear | ntk
  config.model.rope_scaling_factor = 1.0
  # mrope: (time, height, width) frequency pairs summing to rotary_dim / 2; () = Qwen2-VL's 2:3:3 split of
  # whatever head the model has (a d_model or num_heads override keeps it valid)
  config.model.mrope_sections = ()
  # Randomized positions (Ruoss et al. 2023; not with mrope): 0 = off, else training draws each document's
  # positions from [0, randomized_positions_max) (>= model.max_length), sorted.
  config.model.randomized_positions_max = 0
  config.model.randomized_positions_at_eval = False  # evaluation and decoding: 0..n-1 (True: drawn)
  config.model.norm_type = "rmsnorm"  # layernorm | rmsnorm
  config.model.mlp_type = "swiglu"    # mlp (with model.activation) | swiglu
  config.model.activation = "gelu"
  config.model.tie_output = True
  config.model.dropout_rate = 0.0
  config.model.scan_layers = False
  config.model.remat = "none"       # none | full | dots | dots_no_batch
  config.model.implementation = ""  # "" = the attention op's default choice
  return config
