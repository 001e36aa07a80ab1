"""A frozen language model captions a user's images: `image_path<TAB>text` pairs (task "vlm", data.source=tsv).

    python launch.py --config=configs/vlm_tsv.py --workdir=workdirs/vlm_pairs \
        --config.data.train_file=pairs.tsv [--config.data.eval_file=pairs_eval.tsv]

Without an eval file, 5% of the training file's images (every pair of each) are held out for eval, the same ones
by the frozen encoder, the LM and the VLM, so none of them trains on a held-out image or its captions.

Image paths are relative to the file's folder; PNG / JPEG are read grey (RGB with `color=true`) and fitted into
the frozen encoder's canvas (data.image_text). A missing or unreadable image, a line without a tab or an empty side stops the run
before anything is written, naming file and line. Both frozen parts are trained first on the training pairs
when their workdirs hold no finished run (another pairs file needs other workdirs; the launcher names the
field that differs):
  * the LM on their text (configs/vlm_lm.py:text=pairs, in model.lm_workdir, workdirs/vlm_pairs_lm by
    default), so it writes your captions' words;
  * the image encoder on their images, naming each caption's words and word pairs
    (configs/vlm_encoder.py:data=pairs, in model.encoder_workdir, workdirs/vlm_pairs_encoder by default), on
    the canvas `canvas=HxW` (32x32), grey, or RGB with `color=true`.
    `image_encoder=digits` reads your images with the digits' encoder instead (configs/vlm_digits.py's,
    trained on digit strips; its grey 8 x 32 canvas, `scale=s` for 8s x 32s).
"""
from __future__ import annotations

from configs import common
from configs.vlm_digits import CONNECTOR_ARGS, connector_defaults, vlm_config

# image_encoder=...: one trained on the user's own pairs first (configs/vlm_encoder.py:data=pairs), or the
# bundled digits' strip reader.
IMAGE_ENCODERS = ("pairs", "digits")
# Config arguments that only one image encoder reads (kinds: the bundled strips' questions, which no user's pairs
# hold): set off their defaults with the other, they would be ignored without a word.
READ_ONLY_BY = {"canvas": "pairs", "color": "pairs", "scale": "digits", "kinds": None}
DEFAULTS = dict(steps=1000, lr=0.0, connector="flamingo", positions="sequence", merge=1, **CONNECTOR_ARGS,
                kinds="caption", scale=1, encoder="", lm="workdirs/vlm_pairs_lm", bucketing=True, cache=True,
                image_encoder="pairs", canvas="32x32", color=False)


def get_config(arg=None):
  # flamingo by default: of the three it read a user's pairs best at these steps, and steps fastest
  # (experiments/results/intel_xeon_amx/vlm_pairs_encoder.md)
  args = common.parse_arg(arg, **DEFAULTS)
  if args.image_encoder not in IMAGE_ENCODERS:
    raise ValueError(f"config argument image_encoder={args.image_encoder!r}: allowed are {list(IMAGE_ENCODERS)}")
  for key, encoder in READ_ONLY_BY.items():
    if args[key] != DEFAULTS[key] and encoder != args.image_encoder:
      reader = f"image_encoder={encoder} only" if encoder else "the bundled strips only (configs/vlm_digits.py)"
      value = str(args[key]).lower() if isinstance(args[key], bool) else args[key]  # as the argument is written
      raise ValueError(f"config argument {key}={value}: read by {reader}, not by image_encoder={args.image_encoder}")
  connector_defaults(args)  # lr=0: the connector's DEFAULT_LR
  config = vlm_config(args)
  if args.image_encoder == "pairs":
    config.model.encoder_config = (f"configs/vlm_encoder.py:data=pairs,canvas={args.canvas}"  # files named there
                                   + (",color=true" if args.color else ""))
    config.model.encoder_workdir = args.encoder or "workdirs/vlm_pairs_encoder"
    config.data.canvas = args.canvas  # the encoder's: images fitted into it
    config.data.color = args.color    # RGB images (the encoder's too)
  config.model.lm_config = "configs/vlm_lm.py:text=pairs"  # the VLM task names the pairs files there
  config.task.decoding.max_new_tokens = 32  # infer's limit (eval generates as long as its longest caption)
  config.data.source = "tsv"
  config.data.train_file = ""   # required: --config.data.train_file=pairs.tsv
  config.data.eval_file = ""    # optional: without one, 5% of the training file's images are held out, every
  #                               pair of each (data.image_text.held_out_pairs), by the encoder, the LM and the VLM
  return config
