"""Decoder-only language-model tasks: causal LM on text (`lm`, text.py) and algorithmic sequences in the
`input SEP output` format (`lm_algorithmic`, algorithmic.py)."""
from xattn_jax.tasks.lm.algorithmic import LMAlgorithmicTask
from xattn_jax.tasks.decoding_config import decoding_options
from xattn_jax.tasks.lm.text import LanguageModelTask

__all__ = ["LanguageModelTask", "LMAlgorithmicTask", "decoding_options"]
