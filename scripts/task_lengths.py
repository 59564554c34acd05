"""Prompt and answer lengths of reasoning-gym datasets, in characters and in the task_bpe tokenizer's tokens.

For each dataset the script builds the task as `task=reasoning_gym` would, trains its BPE tokenizer exactly as
`model.tokenizer=task_bpe` does (timing it), and prints mean/min/max tokens of held-out prompts and answers
with the character tokenizer (one token a character) and with the BPE tokenizer.

    python scripts/task_lengths.py                                   # the default datasets
    python scripts/task_lengths.py word_sorting:min_words=8 number_sorting:min_numbers=8,max_numbers=12
"""

from __future__ import annotations

import argparse
import ast
import statistics
import time

from gspo_lab.models.builders import TinyModel
from gspo_lab.tasks import ReasoningGym

DEFAULTS = ["word_sorting", "number_sorting", "letter_jumble", "spell_backward", "string_manipulation"]


def parse_spec(spec: str) -> tuple[str, dict]:
    """'name:key=value,key=value' -> (name, {key: value}); values are Python literals where they parse."""
    name, _, settings = spec.partition(":")
    config = {}
    for pair in filter(None, settings.split(",")):
        key, _, value = pair.partition("=")
        try:
            config[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            config[key] = value
    return name, config


def spread(lengths: list[int]) -> str:
    return f"{statistics.mean(lengths):6.1f} [{min(lengths):3d}, {max(lengths):3d}]"


def measure(spec: str, vocab_size: int, n: int) -> str:
    name, config = parse_spec(spec)
    task = ReasoningGym(dataset=name, config=config, eval_size=n)
    started = time.perf_counter()
    bpe = TinyModel(arch="qwen3", tokenizer="task_bpe", tokenizer_vocab_size=vocab_size).build_tokenizer(task)
    seconds = time.perf_counter() - started
    examples = task.eval_examples()  # held out: text the tokenizer was not trained on
    columns = []
    for texts in ([e.prompt for e in examples], [task.demonstration(e) for e in examples]):
        chars = [len(t) for t in texts]
        tokens = [len(bpe(t, add_special_tokens=False)["input_ids"]) for t in texts]
        columns += [spread(chars), spread(tokens)]
    return f"{spec:40s} {seconds:5.2f} s  " + "  ".join(columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("datasets", nargs="*", default=DEFAULTS, help="name or name:key=value,key=value")
    parser.add_argument("--vocab-size", type=int, default=512, help="model.tokenizer_vocab_size (default 512)")
    parser.add_argument("-n", type=int, default=400, help="held-out examples measured per dataset (default 400)")
    args = parser.parse_args()
    print(f"held-out prompts and answers, mean [min, max]; BPE = task_bpe with {args.vocab_size} tokens")
    header = ["prompt chars", "prompt BPE", "answer chars", "answer BPE"]
    print(f"{'dataset':40s} {'BPE fit':>7s}  " + "  ".join(f"{h:>18s}" for h in header))
    for spec in args.datasets:
        print(measure(spec, args.vocab_size, args.n))


if __name__ == "__main__":
    main()
