"""A user's workload, made locally: a tiny chat model saved with save_pretrained (a Qwen3 with a byte-level BPE
tokenizer and a ChatML template, eos <|im_end|>, pad <|endoftext|>, generation_config.eos_token_id listing both,
and more output rows than tokens, as Qwen3 has) and GSM8K-format word problems (`question`, and an `answer`
that works it out and ends in "#### <number>"). Random weights: a cold start on the worked answers
(`sft.enabled=true task.solution_column=answer`) teaches the format. Nothing is downloaded.

    python scripts/make_chat_example.py /tmp/byo                       # /tmp/byo/model, /tmp/byo/word_problems.jsonl
    gspo-train model=hf model.path=/tmp/byo/model task=hf task.path=/tmp/byo/word_problems.jsonl \
        task.prompt_column=question "task.answer_pattern='#### (.+)'" task.solution_column=answer sft.enabled=true \
        reward=math_verify reward.functions.0.latex_only=false rollout.max_new_tokens=16
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXTRA_ROWS = 37  # output rows without a token
NAMES = ["Tom", "Ana", "Li", "Sam", "Ida", "Raj"]
THINGS = ["apples", "books", "coins", "shells"]


def word_problems(n: int, seed: int = 0, largest: int = 19) -> list[dict]:
    """GSM8K-format rows: a one-step addition or subtraction problem, and its worked answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, largest), rng.randint(1, largest)
        if rng.random() < 0.5 or a == b:
            question = f"{who} has {a} {what} and gets {b} more. How many {what} now?"
            work, result = f"{a} + {b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            question = f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
            work, result = f"{a} - {b}", a - b
        rows.append({"question": question, "answer": f"{work} = {result}\n#### {result}", "level": int(a > 9)})
    return rows


def save_tokenizer(folder: Path, texts: list[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_chat_model(folder: Path, seed: int = 0, hidden: int = 32, layers: int = 2, moe: bool = False) -> Path:
    """The tokenizer (trained on word problems) and a random tiny Qwen3 (a Qwen3-MoE of 4 experts top-2 with
    `moe`, the shape of Qwen3-30B-A3B in miniature) in `folder`; returns it."""
    texts = [f"{r['question']} {r['answer']}" for r in word_problems(2000, seed=10_000)]
    tokenizer = save_tokenizer(folder, texts + ["system user assistant think Reason step by step."] * 20)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(seed)
    shape = dict(vocab_size=len(tokenizer) + EXTRA_ROWS, hidden_size=hidden, intermediate_size=2 * hidden,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                 max_position_embeddings=512, eos_token_id=im_end, pad_token_id=endoftext,
                 tie_word_embeddings=not moe)  # Qwen3-30B-A3B unties them (and FSDP here shards them apart)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=hidden, norm_topk_prob=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    model.generation_config.eos_token_id = [im_end, endoftext]
    model.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write model/ and word_problems.jsonl into")
    parser.add_argument("--problems", type=int, default=4000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    save_chat_model(args.out / "model", hidden=args.hidden, layers=args.layers)
    write_jsonl(args.out / "word_problems.jsonl", word_problems(args.problems))
    print(f"{args.out / 'model'}\n{args.out / 'word_problems.jsonl'}")


if __name__ == "__main__":
    main()
