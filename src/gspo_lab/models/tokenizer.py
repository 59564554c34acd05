"""The character tokenizer of the tiny models: a real `PreTrainedTokenizerFast`, built offline.

One token per printable ASCII character plus <pad>, <bos>, <eos> and <unk>. Encoding a text prepends
<bos>; decoding joins characters without spaces. It saves with `save_pretrained` and reloads with
`AutoTokenizer.from_pretrained(path)` like any Hugging Face tokenizer.

>>> tok = char_tokenizer()
>>> ids = tok("12+30=")["input_ids"]
>>> ids[0] == tok.bos_token_id, tok.decode(ids, skip_special_tokens=True)
(True, '12+30=')
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
ALPHABET = "".join(chr(c) for c in range(32, 127))  # printable ASCII, space included


def char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `alphabet`, left-padding (what batched generation needs)."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"tokenizer alphabet has repeated characters: {alphabet!r}")
    specials = list(SPECIAL_TOKENS.values())
    vocab = {token: i for i, token in enumerate(specials + list(alphabet))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character alone
    core.decoder = decoders.Fuse()  # join characters without spaces
    bos = SPECIAL_TOKENS["bos_token"]
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, padding_side="left", **SPECIAL_TOKENS)
