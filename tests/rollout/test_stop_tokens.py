"""A chat checkpoint's stop tokens: the tokenizer's EOS, every id of its generation config's eos_token_id and
rollout.stop_token_ids end a completion, which keeps the stop token; the pad id (often an EOS) never decides."""

import pytest
import torch

from gspo_lab.models.builders import load_pretrained
from gspo_lab.prompts import PromptFormat
from gspo_lab.rollout import token_logprobs
from gspo_lab.rollout.generation import generate, position_ids
from gspo_lab.tasks import Example
from tests.chat_model import EXTRA_ROWS, save_chat_model
from tests.numerics import assert_rounding_close, logit_scale


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    model, tokenizer = load_pretrained(save_chat_model(tmp_path_factory.mktemp("chat")))
    model.eval()
    render = PromptFormat().bind(tokenizer)
    prompts = render.texts([Example(f"Tom has {n} apples.", str(n)) for n in (3, 7, 12, 5)])
    return model, tokenizer, prompts


def sampled(model, tokenizer, prompts, **kwargs):
    """Seeded samples: a row that stops early still draws its later tokens, so two calls agree up to the stop."""
    torch.manual_seed(0)
    return generate(model, tokenizer, prompts, 8, add_special_tokens=False, **kwargs)


@pytest.mark.numerics
@pytest.mark.parametrize("via", ["generation_config", "rollout.stop_token_ids"])
def test_a_second_stop_id_that_is_not_the_tokenizers_ends_the_completion_and_ratios_stay_one(chat, via):
    model, tokenizer, prompts = chat
    free = sampled(model, tokenizer, prompts)  # the random model does not stop by itself in 8 tokens
    assert free.truncated.all()
    stop = int(free.completion_ids[0, 2])  # the third token of row 0 becomes a stop token
    assert stop not in free.completion_ids[0, :2]
    assert stop not in (tokenizer.eos_token_id, tokenizer.pad_token_id)
    saved = model.generation_config.eos_token_id
    if via == "generation_config":
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    try:
        kwargs = {"stop_token_ids": [stop]} if via == "rollout.stop_token_ids" else {}
        out = sampled(model, tokenizer, prompts, return_logprobs=True, **kwargs)
    finally:
        model.generation_config.eos_token_id = saved
    for row, full in zip(range(len(prompts)), free.completion_ids):
        hits = (full == stop).nonzero()
        length = int(hits[0]) + 1 if len(hits) else full.shape[0]  # up to and including the first stop token
        assert int(out.completion_mask[row].sum()) == length and bool(out.truncated[row]) == (len(hits) == 0)
        assert torch.equal(out.completion_ids[row, :length], full[:length])
    assert out.completion_mask[0].tolist()[:4] == [1, 1, 1, 0]
    assert out.texts[0] == tokenizer.decode(free.completion_ids[0, :2])  # the stop token is not in the text
    # the sampled log-probs are the trainer's: an on-policy ratio of 1 on the kept tokens
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        forward, _ = token_logprobs(model, ids, mask, out.completion_ids.shape[1])
        scale = logit_scale(model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits, 1.0)
    valid = out.completion_mask.bool()
    assert_rounding_close(out.logprobs[valid], forward[valid], scale=scale, units=16)


def test_output_rows_without_a_token_decode_to_nothing(chat):
    _, tokenizer, _ = chat
    assert tokenizer.decode([len(tokenizer) + EXTRA_ROWS - 1]) == ""  # Qwen3 has 267 such rows
