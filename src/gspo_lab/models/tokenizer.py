"""The tiny models' tokenizers: real `PreTrainedTokenizerFast`s, built offline.

`char_tokenizer()`: one token per printable ASCII character plus <pad>, <bos>, <eos> and <unk>; right for
today's short arithmetic prompts. `task_bpe_tokenizer(texts, vocab_size)`: a byte-pair tokenizer trained on a
task's own text (prompts and answers), for tasks whose prompts are long English instructions (reasoning-gym).
Both prepend <bos>, decode without inserted spaces, pad on the left (what batched generation needs), save with
`save_pretrained` and reload with `AutoTokenizer.from_pretrained(path)` like any Hugging Face tokenizer.

>>> tok = char_tokenizer()
>>> ids = tok("12+30=")["input_ids"]
>>> ids[0] == tok.bos_token_id, tok.decode(ids, skip_special_tokens=True)
(True, '12+30=')
>>> bpe = task_bpe_tokenizer(["Sort these numbers: 3, 1, 2", "1, 2, 3"] * 50, vocab_size=120)
>>> ids = bpe("Sort these: 1, 2")["input_ids"]
>>> ids[0] == bpe.bos_token_id, bpe.decode(ids, skip_special_tokens=True), len(ids) < len("Sort these: 1, 2")
(True, 'Sort these: 1, 2', True)
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
ALPHABET = "".join(chr(c) for c in range(32, 127))  # printable ASCII, space included
# BPE merges stay inside one piece: a word, a run of digits or a run of punctuation, each with the space before
# it; so a token never straddles two numbers or two words, and answers keep one or a few tokens per item
BPE_PIECES = Regex(r" ?[A-Za-z]+| ?[0-9]+| ?[^A-Za-z0-9 ]+| +")
MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + len(ALPHABET) + 1  # the specials, every ASCII character, one merge


def _finish(core: Tokenizer) -> PreTrainedTokenizerFast:
    """Shared by both tokenizers: decode by plain concatenation, prepend <bos>, pad on the left."""
    core.decoder = decoders.Fuse()  # join tokens without spaces
    bos = SPECIAL_TOKENS["bos_token"]
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, core.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, padding_side="left", **SPECIAL_TOKENS)


def char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `alphabet`."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"tokenizer alphabet has repeated characters: {alphabet!r}")
    specials = list(SPECIAL_TOKENS.values())
    vocab = {token: i for i, token in enumerate(specials + list(alphabet))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character alone
    return _finish(core)


def check_bpe_vocab_size(vocab_size: int) -> None:
    if not vocab_size >= MIN_BPE_VOCAB:
        raise ValueError(
            f"model.tokenizer_vocab_size={vocab_size!r} must be >= {MIN_BPE_VOCAB} "
            "(4 special tokens, the 95 printable ASCII characters and at least one merge)"
        )


def task_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A BPE tokenizer of at most `vocab_size` tokens trained on `texts`; every ASCII character stays a token,
    so any ASCII string round-trips, and other characters are <unk> unless the texts contain them."""
    check_bpe_vocab_size(vocab_size)
    core = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(BPE_PIECES, behavior="isolated")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=list(ALPHABET),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    return _finish(core)
