"""A frozen language model reads digit strips through one of three connectors (task "vlm").

    python launch.py --config=configs/vlm_digits.py:connector=flamingo --workdir=workdirs/vlm_flamingo
    python launch.py --config=configs/vlm_digits.py:connector=qformer --workdir=workdirs/vlm_qformer
    python launch.py --config=configs/vlm_digits.py:connector=llava --workdir=workdirs/vlm_llava
    python launch.py --config=configs/vlm_digits.py:connector=llava,positions=mrope --workdir=workdirs/vlm_llava_mrope
    python launch.py --config=configs/vlm_digits.py:connector=llava,merge=2 --workdir=workdirs/vlm_llava_merge2
    python launch.py --config=configs/vlm_digits.py:connector=qformer,scale=2 --workdir=workdirs/vlm_qformer_x2
    python launch.py --config=configs/vlm_digits.py:connector=qformer,bucketing=false --workdir=workdirs/vlm_qformer_p
    python launch.py --config=configs/vlm_digits.py:connector=qformer,distill=1 --workdir=workdirs/vlm_qformer_d
    printf 'strip.png\twhat is their sum ?\n' | python launch.py --config=configs/vlm_digits.py:connector=llava \
        --workdir=workdirs/vlm_llava --mode=infer

The frozen parts are trained first when their workdirs hold no finished run (task dependencies; both missing,
they train side by side: launch.py's --dependencies): the image
encoder by configs/vlm_encoder.py in workdirs/vlm_encoder (at `scale=s`, digits of 8s x 8s pixels, by
configs/vlm_encoder.py:scale=s in workdirs/vlm_encoder_xs) and the LM by configs/vlm_lm.py in workdirs/vlm_lm,
shared by all three connectors (see xattn_jax/tasks/vlm/frozen.py). `distill=W` adds description distillation
(task.distill_weight; experiments/results/intel_xeon_amx/vlm_description_distillation.md).
"""
from __future__ import annotations

from ml_collections import ConfigDict

from configs import common
from xattn_jax.models import connectors

# The config arguments of connectors' own fields, at the value their connector owns (`own_fields`): configs/vlm_tsv.py
# takes them from here.
CONNECTOR_ARGS = dict(queries=connectors.config_defaults()["num_queries"],
                      latents=connectors.config_defaults()["num_latents"])


def vlm_config(args) -> ConfigDict:
  """What both VLM configs share: the loop, the model and the frozen parts (args from common.parse_arg)."""
  config = common.base_config(total_steps=args.steps, batch_size=getattr(args, "batch", 32), eval_batch_size=64,
                              log_every_steps=50, eval_every_steps=args.steps, checkpoint_every_steps=args.steps,
                              learning_rate=args.lr, warmup_steps=50)
  # One CPU device a core: the connector's step is many small products that XLA:CPU runs on one core, and its
  # batch splits over the cores (common.base_config's cpu_devices). Its frozen parts train side by side: the
  # image encoder on one device, the LM, which outlasts it, on one a core (configs/vlm_lm.py).
  config.cpu_devices = 0
  config.task.name = "vlm"
  config.task.decoding = ConfigDict({
      "method": "greedy",     # greedy | beam | sample (decoding.DecodingOptions checks every option)
      "beam_size": 4,
      "alpha": 0.6,
      "temperature": 1.0,
      "top_k": 0,
      "top_p": 1.0,
      "seed": 0,
      "cache_halves": True,   # a cache's first half decodes on that half alone (1.5x its memory meanwhile)
      "max_new_tokens": 8,    # a target's tokens and the token that ends it
  })
  # > 0: the LM's states reading the image are also pulled toward its states reading the image's description
  # in words (digits only; tasks.vlm.distillation.description_distillation), with this weight beside the cross-entropy
  config.task.distill_weight = getattr(args, "distill", 0.0)  # configs/vlm_tsv.py: no descriptions
  config.task.distill_blocks = getattr(args, "distill_blocks", 0)  # the first n LM blocks' outputs (0: all)
  # True: eval and infer answer in two passes: the model describes each image alone, then the frozen LM answers
  # from the text with the description before the image's marker, as it learned from the described texts
  # (digits only; tasks.vlm.answers.described_answers). An eval-time choice: --mode=eval may set it.
  config.task.describe_first = False
  config.checkpoint.best_metric = "eval/exact_match"
  config.checkpoint.best_mode = "max"
  config.optimizer.weight_decay = 0.01
  config.model.name = "vlm"
  config.model.connector = args.connector     # flamingo | qformer | llava (models.connectors.CONNECTORS)
  # the encoder at the images' scale, trained first when its workdir is empty (workdirs/vlm_encoder_xS by default)
  scaled = args.scale != 1
  config.model.encoder_workdir = args.encoder or "workdirs/vlm_encoder" + (f"_x{args.scale}" if scaled else "")
  config.model.encoder_config = "configs/vlm_encoder.py" + (f":scale={args.scale}" if scaled else "")
  config.model.lm_workdir = args.lm
  config.model.lm_config = "configs/vlm_lm.py"
  config.model.hide_padding = False           # the encoder was trained on the padded canvas: padding reads "empty"
  config.model.num_heads = 4
  config.model.mlp_ratio = 2
  config.model.dropout_rate = 0.0
  # each connector's own fields at their value in its `own_fields` (models/connectors.py, which says what each is)
  config.model.update(connectors.config_defaults())
  config.model.num_latents = args.latents     # flamingo: Perceiver resampler latents (0 = read the features)
  config.model.num_queries = args.queries     # qformer: N soft tokens per image
  config.model.image_positions = args.positions  # sequence | mrope (Qwen2-VL; llava only)
  config.model.spatial_merge = args.merge     # llava: m x m patches per soft token (Qwen2-VL's merger: 2)
  config.model.feature_positions = "learned_2d"  # connectors.feature_position_encodings(): the grid positions
  config.data = ConfigDict({
      "source": "digits",                     # digits | tsv (tasks.vlm.task.SOURCES)
      "max_digits": 4,                        # the canvas: 8 x (8 * max_digits), times scale (the encoder's)
      "scale": args.scale,                    # digits of 8s x 8s pixels: M = 1 + 16 k s^2 features with 2 x 2 patches
      "kinds": ",".join(args.kinds.split("+")),
      "num_train_examples": 20000,
      "num_eval_examples": 256,
      "seed": 0,
      "eval_seed": 0,
      "train_file": "",
      "eval_file": "",
      # batches padded to their own examples' images and tokens (tasks/vlm/task.py); False: to the longest example
      # and two image slots, the bundled strips cycled in their drawn order
      "length_bucketing": args.bucketing,
      # the training images' frozen features computed once, not in every step (tasks/vlm/task.py)
      "cache_features": args.cache,
  })
  return config


# Each connector's steps when the config names none: about 10 minutes of training on 2 CPU cores (bucketed
# batches, cached features). llava hands the LM 16 soft tokens a digit and the Q-Former 33 an image, so their
# steps cost about 2.3x and 1.9x flamingo's. Flamingo, the default chain's connector, trains 12,000 so that
# the chain (encoder and LM, then flamingo) ends inside 15 minutes; 14,000 read 0.003 more
# (experiments/results/intel_xeon_amx/compare_connectors_flamingo_12000_steps.md).
DEFAULT_STEPS = {"flamingo": 12000, "qformer": 8000, "llava": 6000}
# Each connector's peak learning rate when the config names none. llava's projector is a per-patch MLP of
# ~29k parameters and learns fastest at the highest of these (experiments/results/amd_epyc_avx512/llava_lr.md).
DEFAULT_LR = {"flamingo": 3e-3, "qformer": 3e-3, "llava": 1e-2}


def connector_defaults(args) -> None:
  """args.steps / args.lr of 0: the connector's DEFAULT_STEPS / DEFAULT_LR (at scale 1; larger images cost
  more a step). An unknown connector gets the smallest, and validation names model.connector."""
  if not args.steps:
    args.steps = DEFAULT_STEPS.get(args.connector, min(DEFAULT_STEPS.values()))
  if not args.lr:
    args.lr = DEFAULT_LR.get(args.connector, min(DEFAULT_LR.values()))


def get_config(arg=None):
  # steps=0, lr=0: the connector's DEFAULT_STEPS, DEFAULT_LR; distill=W: task.distill_weight (0: off); batch=B:
  # the batch size (64 at 10,000 steps gave flamingo no gain: experiments/results/intel_xeon_amx/vlm_trials_stop54.md)
  args = common.parse_arg(arg, steps=0, lr=0.0, batch=32, connector="flamingo", positions="sequence", merge=1,
                          **CONNECTOR_ARGS, kinds="caption+count+nth+sum+larger", scale=1, encoder="",
                          lm="workdirs/vlm_lm", bucketing=True, cache=True, distill=0.0,
                          distill_blocks=0)
  connector_defaults(args)
  config = vlm_config(args)
  # the split eval reads (vlm_digits.EVAL_SPLITS): validation while training and choosing; test for the final
  # score (launch.py --mode=eval --config.data.eval_split=test), as experiments/compare_connectors.py does
  config.data.eval_split = "validation"
  return config
