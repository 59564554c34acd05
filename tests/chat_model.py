"""A tiny chat model as a user has one: a Qwen3 saved with save_pretrained, a byte-level BPE tokenizer with a
ChatML template (eos <|im_end|>, pad <|endoftext|>), a generation config whose eos_token_id lists both, and
more output rows than tokens (as Qwen3: 151,936 rows, 151,669 tokens); and GSM8K-format data files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXTRA_ROWS = 37  # output rows without a token


def word_problems(n: int, seed: int = 0) -> list[dict]:
    """GSM8K-format rows: a question, and an answer that works it out and ends in '#### <number>'."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in torch.randint(1, 20, (2,), generator=g))
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                     "answer": f"{a} + {b} = {a + b}\n#### {a + b}", "level": int(a > 9)})
    return rows


def save_chat_model(folder: Path, seed: int = 0) -> Path:
    """The tokenizer (trained on word problems) and a random tiny Qwen3 in `folder`; returns it."""
    texts = [f"{r['question']} {r['answer']}" for r in word_problems(400)] + ["system user assistant think"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer) + EXTRA_ROWS, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512, eos_token_id=im_end, pad_token_id=endoftext,
                         tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = [im_end, endoftext]
    model.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
