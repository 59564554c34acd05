"""Tiny learned graders saved with save_pretrained, as a user's would be: a reward model (one-label sequence
classifier) and a judge (causal LM), one-layer Qwen3s over the char vocabulary with random weights (seed 0)."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification

from gspo_lab.models.tokenizer import char_tokenizer

YES_NO = {"y": 1.0, "n": 0.0}  # a judge's verdicts: with the char tokenizer " yes" and " no" both start with " "


def save_grader(folder, causal: bool = False, num_labels: int = 1, head_dim: int = 16):
    """A reward model (or, with `causal`, a judge) saved with its tokenizer in `folder` (`head_dim` 32 for vLLM's
    CPU kernels)."""
    tokenizer = char_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    (Qwen3ForCausalLM if causal else Qwen3ForSequenceClassification)(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
