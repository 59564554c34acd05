"""Tool results as tokens, through the chat template's tool role, appended to what the model generated.

Token in, token out: earlier turns are never re-rendered or re-tokenised; the tokens trained on are exactly the
ones the model generated. A tool result enters as the tokens the template puts between the end of an assistant
turn (its stop token) and the next generation prompt, found by rendering a small conversation with and without
the tool messages (`tool_suffix_ids`, TRL's `_get_tool_suffix_ids`). That needs a prefix-preserving template:
one that renders earlier messages the same whatever follows. Qwen3's strips the <think> block of an assistant
turn once a later user turn exists, and other templates drop tool calls; `check_prefix_preserving` refuses such a
template with the way out (a training template saved with the tokenizer, as TRL's
`get_training_chat_template` gives).

The tiny models' tokenizers have no chat template; a task with tools gives them `TINY_TOOL_TEMPLATE`
(`with_tool_template`): the prompt as it is, each assistant turn's text and its calls, ended by EOS, each tool
result in <tool_response> tags. Its four tags are tokens of their own. The calls are written in the pythonic
format (Llama 3.2's and vLLM's `pythonic` parser's), `<tool_call>[calculate(expression="12*34")]</tool_call>`:
half the tokens of the JSON format, so that a character-level model has half the chances to break a call.
`gspo_lab.tools.calls` reads it.

Where TRL is installed, a tokenizer is first prepared as TRL's GRPOTrainer prepares it (`prepare_as_trl`): a
response template for the chat templates TRL knows (Llama 3.x's JSON calls, Qwen3's, GLM-4.5's, GPT-OSS's, ...),
and TRL's training template where the shipped one is not prefix-preserving (Qwen3's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)

TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TINY_TOOL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- message.content or '' -}}"
    "{%- if message.tool_calls -%}<tool_call>["
    "{%- for call in message.tool_calls -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{{- f.name }}("
    "{%- for key, value in f.arguments.items() -%}{{ key }}={{ value | tojson }}{% if not loop.last %},{% endif %}"
    "{%- endfor -%})"
    "{%- if not loop.last %},{% endif -%}"
    "{%- endfor -%}]</tool_call>"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif message.role == 'tool' -%}"
    "<tool_response>{{ message.content }}</tool_response>"
    "{%- else -%}"
    "{{- message.content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
DUMMY_USER = {"role": "user", "content": "dummy"}


def with_tool_template(tokenizer):
    """The tokenizer, given the tool tags as tokens of their own and `TINY_TOOL_TEMPLATE` (a tiny model's: it
    has no template of its own)."""
    tokenizer.add_tokens(list(TOOL_TAGS))
    tokenizer.chat_template = TINY_TOOL_TEMPLATE
    return tokenizer


def _render(tokenizer, messages: list[dict], generation_prompt: bool, kwargs: dict) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                        return_dict=False, **kwargs)
    return list(ids)


def _cut_after_last_eos(tokenizer, ids: list[int]) -> list[int]:
    """`ids` up to and including their last EOS (Qwen's templates write "<|im_end|>\\n": the model stops at
    <|im_end|>, so the newline belongs to what follows)."""
    ends = [i for i, token in enumerate(ids) if token == tokenizer.eos_token_id]
    return ids[: ends[-1] + 1] if ends else ids


def tool_suffix_ids(tokenizer, tool_messages: Sequence[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """The tokens that follow an assistant turn's stop token when `tool_messages` answer it, up to and including
    the next generation prompt."""
    kwargs = dict(chat_template_kwargs or {})
    call = [{"type": "function", "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}]
    before = [DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = _cut_after_last_eos(tokenizer, _render(tokenizer, before, False, kwargs))
    full = _render(tokenizer, before + list(tool_messages), True, kwargs)
    if full[: len(prefix)] != prefix:
        raise ValueError(not_prefix_preserving(tokenizer))
    return full[len(prefix):]


def assistant_ids(tokenizer, message: dict, chat_template_kwargs: dict | None = None) -> list[int]:
    """The tokens of one assistant turn as the template renders it, up to and including its stop token: what a
    demonstration's turn trains on (gspo_lab.sft)."""
    kwargs = dict(chat_template_kwargs or {})
    prompt = _render(tokenizer, [DUMMY_USER], True, kwargs)
    full = _cut_after_last_eos(tokenizer, _render(tokenizer, [DUMMY_USER, message], False, kwargs))
    if full[: len(prompt)] != prompt:
        raise ValueError(not_prefix_preserving(tokenizer))
    return full[len(prompt):]


def demonstration_ids(tokenizer, messages: Sequence[dict], chat_template_kwargs: dict | None = None
                      ) -> tuple[list[int], list[int]]:
    """A multi-turn demonstration (its assistant and tool messages, after the prompt) as the tokens a rollout
    would hold, and the mask of the model's own (1) against the tools' results (0): the cold start trains on the
    model's tokens only, as RL does.

    >>> from gspo_lab.models.tokenizer import char_tokenizer
    >>> tok = with_tool_template(char_tokenizer())
    >>> call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    >>> ids, mask = demonstration_ids(tok, [{"role": "assistant", "content": "", "tool_calls": [call]},
    ...                                     {"role": "tool", "name": "f", "content": "2"},
    ...                                     {"role": "assistant", "content": "2"}])
    >>> tok.decode(ids), mask.count(0)
    ('<tool_call>[f(x=1)]</tool_call><eos><tool_response>2</tool_response>2<eos>', 3)
    """
    ids, mask, start = [], [], 0
    while start < len(messages):
        end = start + 1
        if messages[start]["role"] == "tool":
            while end < len(messages) and messages[end]["role"] == "tool":
                end += 1
            piece, mine = tool_suffix_ids(tokenizer, messages[start:end], chat_template_kwargs), 0
        else:
            piece, mine = assistant_ids(tokenizer, messages[start], chat_template_kwargs), 1
        ids += piece
        mask += [mine] * len(piece)
        start = end
    return ids, mask


def not_prefix_preserving(tokenizer) -> str:
    return (f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} is not "
            "prefix-preserving: it renders an earlier turn differently once a tool result follows (Qwen3's strips "
            "<think> blocks; some templates drop tool calls), so the tokens trained on would not be the ones "
            "generated. Save the checkpoint's tokenizer with a training template that keeps every turn as it was "
            "(TRL's trl.chat_template_utils.get_training_chat_template, which is used by itself where TRL is "
            "installed and knows the template, Qwen3's among them), or use a model whose template preserves prefixes")


def prepare_as_trl(tokenizer, chat_template_kwargs: dict | None = None) -> None:
    """What TRL's GRPOTrainer does to a tool task's tokenizer, done here where TRL is installed: its response
    template for a chat template TRL knows (`add_response_schema`, from the template as shipped: Llama 3.2 writes
    its calls as bare JSON, which nothing else here reads), then TRL's training template where the shipped one is
    not prefix-preserving (`get_training_chat_template`: Qwen3's). A template TRL does not know is left as it is."""
    try:
        from trl.chat_template_utils import add_response_schema, get_training_chat_template
    except ImportError:
        return
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError:  # a template TRL does not know: the Hermes or pythonic format is read (tools.calls)
            pass
    try:
        check_prefix_preserving(tokenizer, chat_template_kwargs)
    except ValueError:
        try:
            training = get_training_chat_template(tokenizer)
        except ValueError:  # TRL has no training template for it: check_prefix_preserving refuses it
            return
        if training is not None:
            log.info("the tokenizer's chat template is not prefix-preserving: TRL's training template for it is used, "
                     "as TRL's GRPOTrainer does")
            tokenizer.chat_template = training


def check_prefix_preserving(tokenizer, chat_template_kwargs: dict | None = None) -> None:
    """Refuse a template that renders an assistant turn (with its reasoning and a tool call) differently once a
    tool result follows it; the refusal says what to do."""
    kwargs = dict(chat_template_kwargs or {})
    call = [{"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}]
    turn = {"role": "assistant", "content": "<think>\nprobe\n</think>\n\nprobe", "tool_calls": call}
    before = _cut_after_last_eos(tokenizer, _render(tokenizer, [DUMMY_USER, turn], False, kwargs))
    tool = {"role": "tool", "name": "probe", "content": "probe"}
    after = _render(tokenizer, [DUMMY_USER, turn, tool, {"role": "assistant", "content": "done"},
                                {"role": "user", "content": "again"}], True, kwargs)
    if after[: len(before)] != before:
        raise ValueError(not_prefix_preserving(tokenizer))
