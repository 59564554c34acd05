"""rollout.backend=replay: completions recorded in a file, replayed instead of sampled. A rollout backend in one
file (gspo_lab.rollout.backend; docs/how-to/extend.md shows how it plugs in), and a control a study can use: the
update on known completions, with nothing left to sampling.

    gspo-train rollout=replay rollout.options.path=recorded.jsonl

Each line of the file: {"prompt": <the model input, as the run's prompt format renders it>, "completions": [<text>,
...]}. The j-th row of a prompt in a `generate` call (a group's j-th completion) gets its j-th recorded completion
(cycling through them), ended with the tokenizer's EOS and cut at max_new_tokens: nothing depends on earlier
steps, so a resumed run replays what an uninterrupted one would. A line with "prompt": null answers every prompt
without a line of its own: the k-th such row of a call gets its k-th completion (the variable-length workload,
conf/experiment/bench_varlen.yaml). The log-probs returned are the trainer's own of
those tokens (a no-grad forward of the policy as it stands at the rollout), as an engine's of its own samples
would be.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.backend import RunSettings, Sampling
from gspo_lab.rollout.completions import Generated, cut_at_stop, stop_ids
from gspo_lab.rollout.logprobs import token_logprobs
from gspo_lab.rollout.packing import MIN_SAVING, packs_exactly
from gspo_lab.tasks.jsonl import json_lines

SETTINGS = ("path",)  # rollout.options.*


class ReplayBackend:
    """Replays the completions recorded in rollout.options.path (`load_recorded`)."""

    name: ClassVar[str] = "replay"
    continues_from_token_ids: ClassVar[bool] = False  # a recorded completion cannot answer a tool result
    samples_synced_weights: ClassVar[bool] = False  # it samples no weights at all: no weight version
    returns_logprobs: ClassVar[bool] = False  # its log-probs are the trainer's, recomputed: no engine's to replace
    returns_experts: ClassVar[bool] = False  # recorded completions come with no experts
    serves_evaluation: ClassVar[bool] = False  # evaluation samples from the policy itself
    runs_apart: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module, rollout: RolloutConfig) -> None:
        self.model = model
        self.recorded = load_recorded(recording(rollout.options))
        self.padding_free = True  # log-probs packed where the model packs exactly (train.padding_free)

    @classmethod
    def check(cls, run: RunSettings) -> None:
        """The file must exist and parse."""
        unknown = sorted(set(run.rollout.options) - set(SETTINGS))
        if unknown:
            raise ValueError(f"rollout.options.{unknown[0]} is not a setting of rollout.backend=replay (one of "
                             f"{list(SETTINGS)})")
        load_recorded(recording(run.rollout.options))

    @classmethod
    def exact_logprobs(cls, rollout: RolloutConfig) -> bool:
        """No engine's: the trainer computes them."""
        return False

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def sync(self) -> None:
        """Nothing to take: the log-probs come from the trainer's model itself."""

    def close(self) -> None:
        """Nothing runs beside the trainer."""

    def generate(self, tokenizer, prompts: list[str], sampling: Sampling, row_seeds: Tensor | None = None,
                 routing=None) -> Generated:
        """Each prompt's recorded completion for its place in the call, with the policy's log-probs of its tokens;
        no routing trace."""
        seen: Counter[str | None] = Counter()  # each prompt's rows so far in this call (None: any prompt's)
        texts = []
        for prompt in prompts:
            key = prompt if prompt in self.recorded or None not in self.recorded else None
            texts.append(self.completion(key, seen[key]))
            seen[key] += 1
        device = next(self.model.parameters()).device
        encoded = tokenizer(prompts, return_tensors="pt", padding=True,
                            add_special_tokens=sampling.add_special_tokens).to(device)
        stop = stop_ids(tokenizer, self.model, sampling.stop_token_ids)
        end = [] if sampling.suppress_eos else [stop[0]]
        rows = [(tokenizer(text, add_special_tokens=False)["input_ids"] + end)[: sampling.max_new_tokens]
                for text in texts]
        width = max(1, max(len(row) for row in rows))
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long, device=device)  # [N, C]
        written = torch.zeros(len(rows), width, dtype=torch.bool, device=device)  # [N, C]
        for n, row in enumerate(rows):
            ids[n, : len(row)] = torch.tensor(row, dtype=torch.long)
            written[n, : len(row)] = True
        completions = cut_at_stop(tokenizer, encoded["input_ids"], encoded["attention_mask"], ids,
                                  [] if sampling.suppress_eos else stop, generated=written)
        if sampling.logprobs:
            with torch.no_grad():
                completions.logprobs = token_logprobs(
                    self.model, torch.cat([completions.prompt_ids, completions.completion_ids], 1),
                    torch.cat([completions.prompt_mask, completions.completion_mask], 1), width,
                    sampling.temperature, packed=self.padding_free and packs_exactly(self.model),
                    pack_min_saving=MIN_SAVING)[0] * completions.completion_mask
        return Generated(completions)

    def completion(self, prompt: str | None, index: int) -> str:
        """The prompt's `index`-th recorded completion, cycling."""
        if prompt not in self.recorded:
            raise ValueError(f"rollout.backend=replay: no completions recorded for the prompt {prompt!r}")
        completions = self.recorded[prompt]
        return completions[index % len(completions)]


def recording(options: dict) -> Path:
    """rollout.options.path, which must be given."""
    if not options.get("path"):
        raise ValueError("rollout.backend=replay needs rollout.options.path, the JSONL file of recorded completions")
    return Path(str(options["path"])).expanduser()


def load_recorded(path: Path) -> dict[str | None, list[str]]:
    """The recorded completions of each prompt; ValueError naming the file and the line that breaks the format."""
    if not path.is_file():
        raise ValueError(f"rollout.options.path={str(path)!r}: no such file")
    recorded: dict[str | None, list[str]] = {}
    for where, row in json_lines(path):
        row = row if isinstance(row, dict) else {}
        completions = row.get("completions")
        if not (isinstance(row.get("prompt"), (str, type(None))) and isinstance(completions, list) and completions
                and all(isinstance(c, str) for c in completions)):
            raise ValueError(f"{where}: must be {{\"prompt\": <text or null>, \"completions\": [<text>, ...]}} "
                             "with at least one completion")
        recorded.setdefault(row["prompt"], []).extend(completions)
    return recorded
