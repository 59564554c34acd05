"""A rollout backend that writes scripted turns, for testing the multi-turn loop's bookkeeping exactly: a row's
next turn is `script(everything so far, as text)`, its log-prob -0.5 per token. It satisfies the backend contract (token-id
prompts, per-row seeds, the budget), and records the seeds each call gave each prompt."""

from __future__ import annotations

import torch

from gspo_lab.rollout.completions import Generated, cut_at_stop


class ScriptedBackend:
    name = "scripted"
    serves_evaluation = False
    dtype = "float32"

    def __init__(self, script) -> None:
        self.script = script  # the context so far (text) -> the next turn's text (its stop token added here)
        self.calls: list[dict] = []  # per call: prompt texts and seeds

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(self, tokenizer, prompts, sampling, row_seeds=None, routing=None) -> Generated:
        texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
        self.calls.append({"texts": texts, "seeds": None if row_seeds is None else row_seeds.tolist()})
        rows = []
        for text in texts:
            ids = tokenizer(self.script(text), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(ids[: sampling.max_new_tokens])
        width = max(len(ids) for ids in prompts)
        prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        length = max(len(r) for r in rows)
        completion = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])
        generated = torch.tensor([[True] * len(r) + [False] * (length - len(r)) for r in rows])
        logprobs = torch.full(completion.shape, -0.5) * generated
        return Generated(cut_at_stop(tokenizer, prompt_ids, prompt_mask, completion, [tokenizer.eos_token_id],
                                     logprobs, generated))
