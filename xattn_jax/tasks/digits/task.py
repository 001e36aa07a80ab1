"""The "digits" task: classification of scikit-learn's bundled 8x8 digits, by one of three model families.

`config.model.name` picks the family's task from MODELS, each in its own module over the shared data,
metrics and inference of `common.py`:

- "vit": the small ViT that is later frozen as the Q-Former's encoder (`vit.py`, `configs/vit_digits.py`);
- "perceiver": the Perceiver latent reader over pixels or patches (`perceiver.py`, `configs/perceiver_digits.py`);
- "qformer": learned queries (or, with `model.connector="llava"`, an MLP connector) over the frozen ViT's
  patch features (`qformer.py`, `configs/qformer_digits.py`); it declares the ViT run as a dependency.
"""
from __future__ import annotations

from xattn_jax.tasks.digits import common, perceiver, qformer, vit
from xattn_jax.training import task as task_lib, validation

EVAL_METRICS = common.EVAL_METRICS
# model.name -> the task of that model family: the one list of them that config checks and errors read.
MODELS: dict[str, type[common.DigitsBase]] = {
    "vit": vit.ViTTask,
    "perceiver": perceiver.PerceiverTask,
    "qformer": qformer.QFormerTask,
}


def model_task(config) -> type[common.DigitsBase]:
  """The task class of config.model.name; ConfigError for another name."""
  validation.require_choice(config, "model.name", MODELS)
  return MODELS[config.model.name]


@task_lib.register("digits")
class DigitsTask(common.DigitsBase):
  """Stands for the task of `config.model.name`: constructing it builds that task, and its classmethods
  are that task's."""
  # The Perceiver's grid encodings: the one family with a model.position_encoding (validation reads these
  # before it knows the family, so an unknown name is answered with the values a digits model takes).
  position_encodings = staticmethod(perceiver.PerceiverTask.position_encodings)

  def __new__(cls, config, workdir=None, mode="train"):
    # Not an instance of DigitsTask, so Python does not run __init__ on it a second time.
    return model_task(config)(config, workdir, mode)

  @classmethod
  def validate(cls, config, mode="train"):
    model_task(config).validate(config, mode)

  @classmethod
  def dependencies(cls, config, workdir):
    return model_task(config).dependencies(config, workdir)
