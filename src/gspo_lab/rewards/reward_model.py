"""A learned reward: a sequence-classification model's score of each (prompt, completion), with TRL's contract.

    reward=reward_model reward.functions.0.path=/path/to/reward_model
    reward.functions=[/path/to/reward_model]          # TRL's form: a model path or id in the reward list

TRL's GRPOTrainer loads a model id in `reward_funcs` as `AutoModelForSequenceClassification(num_labels=1)` with its
own tokenizer, renders a conversational prompt and completion with that tokenizer's chat template (plain ones as
prompt + completion), tokenizes without special tokens, pads on the right and takes `logits[:, 0]`. `RewardModel`
does the same, in batches of `batch_size` under inference mode, never once per completion, so a TRL user's reward
model scores alike here. Beyond TRL: `max_length` (longer inputs lose their start, so the completion's end, which
the model's last-token pooling reads, stays), `dtype`, `device` (null: the GPU where there is one, as the trainer)
and `offload` (the model goes back to the host between calls, freeing the device for the step).

Checked when built, naming the key: the folder or id loads, its head has one label and its weights are in the
checkpoint (a causal LM saved with num_labels=1 would score with a random head); and at the first
conversational call, that the tokenizer has a chat template. It scores in the training process (reward.num_workers
0): a grading worker would hold a copy of the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gspo_lab.grading.answers import text_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModel:
    """A reward function backed by a sequence-classification model with one label (`__call__`: TRL's contract).
    `batched`: gspo_lab.rewards.WeightedRewards calls it once with all of a round's completions."""

    batched = True

    def __init__(self, path: str, tokenizer: str | None = None, batch_size: int = 32, max_length: int | None = None,
                 dtype: str = "float32", device: str | None = None, offload: bool = False,
                 chat_template_kwargs: dict | None = None, key: str = "reward.functions.<i>") -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{key}.batch_size={batch_size!r} is invalid: must be an integer >= 1")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise ValueError(f"{key}.max_length={max_length!r} is invalid: must be null or an integer >= 2")
        if dtype not in DTYPES:
            raise ValueError(f"{key}.dtype={dtype!r} is invalid: must be one of {list(DTYPES)}")
        path = str(Path(str(path)).expanduser())  # a folder under ~; a hub id stays as it is
        self.path, self.batch_size, self.max_length, self.offload = path, batch_size, max_length, offload
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.__name__ = Path(self.path).name or self.path
        try:
            config = AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError) as error:
            raise ValueError(f"{key}.path={self.path!r}: no reward model there (a save_pretrained folder or a hub id "
                             f"in the local cache): {error}") from None
        if config.num_labels != 1:
            raise ValueError(f"{key}.path={self.path!r}: its head has {config.num_labels} labels; a reward model "
                             "scores with one (AutoModelForSequenceClassification, num_labels=1)")
        self.model, loading = AutoModelForSequenceClassification.from_pretrained(
            self.path, num_labels=1, dtype=DTYPES[dtype], output_loading_info=True)
        prefix = f"{self.model.base_model_prefix}."
        head = sorted(name for name in loading.get("missing_keys", ()) if not name.startswith(prefix))
        if head:  # a causal LM saved with num_labels=1: its score head would be random
            raise ValueError(f"{key}.path={self.path!r}: the checkpoint has no weights for the score head {head} "
                             "(transformers would initialise it at random); is it a causal LM? A reward model is a "
                             "sequence classifier trained with its head (scripts/train_reward_model.py)")
        self.model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or self.path)
        if self.tokenizer.pad_token_id is None:  # TRL's fallback
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"
        self.key = key
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.model.to("cpu" if offload else self.device)

    def texts(self, prompts: list, completions: list) -> list[str]:
        """Each prompt with its completion, as the model reads them (`scored_texts`)."""
        return scored_texts(self.tokenizer, prompts, completions, self.chat_template_kwargs, self.key)

    @torch.inference_mode()
    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        """The model's score of each (prompt, completion), in batches of `batch_size`."""
        texts = self.texts(list(prompts), list(completions))
        self.model.to(self.device)
        scores = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False,
                                    truncation=self.max_length is not None, max_length=self.max_length)
            logits = self.model(**inputs.to(self.device)).logits  # [b, 1]
            scores += logits[:, 0].float().tolist()
        if self.offload:
            self.model.to("cpu")
        return scores


def scored_texts(tokenizer, prompts: list, completions: list, chat_template_kwargs: dict | None = None,
                 key: str = "reward.functions.<i>") -> list[str]:
    """Each prompt with its completion as a reward model reads them, scoring or in training
    (scripts/train_reward_model.py): a conversation through the tokenizer's chat template, or the plain texts
    joined. The prompts are what reward functions get (the data's prompts, not the policy's rendered input)."""
    if prompts and isinstance(prompts[0], list):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{key}: the prompts are conversations and the reward model's tokenizer "
                             f"({tokenizer.name_or_path}) has no chat template; give one that has ({key}.tokenizer) "
                             "or plain prompts")
        return [tokenizer.apply_chat_template(p + c, tokenize=False, **(chat_template_kwargs or {}))
                for p, c in zip(prompts, completions)]
    return [p + text_of(c) for p, c in zip(prompts, completions)]
