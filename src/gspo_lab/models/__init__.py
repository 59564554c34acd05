"""Tiny models built from config, local pretrained checkpoints, and the character tokenizer."""

from gspo_lab.models import experts  # noqa: F401 - registers experts_implementation=index_add
from gspo_lab.models.builders import PretrainedModel, TinyModel, parameter_count
from gspo_lab.models.tokenizer import char_tokenizer

__all__ = ["PretrainedModel", "TinyModel", "char_tokenizer", "parameter_count"]
