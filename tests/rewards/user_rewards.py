"""Reward functions as a user writes them for TRL, in their own module, reached through `_target_`; some with
the bugs a grader must survive."""

import time


def ends_with_answer(prompts, completions, answer, **kwargs):
    """1 where the completion ends with the reference answer (reasoning before it allowed)."""
    return [1.0 if c.strip().endswith(a) else 0.0 for c, a in zip(completions, answer)]


def short(completions, max_chars=3, **kwargs):
    """A shaping term that applies to short completions only: None elsewhere."""
    return [0.5 if len(c) <= max_chars else None for c in completions]


def even_length(completions, completion_ids, **kwargs):
    """Scores a completion of an even number of tokens by that number, and no other (None): those are unscorable."""
    return [float(len(ids)) if len(ids) % 2 == 0 else None for ids in completion_ids]


def flaky(prompts, completions, **kwargs):
    """Raises on completions containing '7'."""
    if any("7" in c for c in completions):
        raise KeyError("bug in the reward function")
    return [1.0] * len(completions)


def sleepy(prompts, completions, **kwargs):
    """Never returns on completions containing '7' (a verifier stuck in C code looks the same from outside)."""
    if any("7" in c for c in completions):
        time.sleep(3600)
    return [0.0] * len(completions)


def wrong_length(prompts, completions, **kwargs):
    return [1.0, 1.0]


def non_finite(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


class LengthPenalty:
    """A callable class with settings, as TRL users write them."""

    def __init__(self, per_char=0.01):
        self.per_char = per_char

    def __call__(self, completions, **kwargs):
        return [-self.per_char * len(c) for c in completions]


def needs_solution(completions, solution, **kwargs):
    """TRL's accuracy_reward's signature: needs a `solution` column."""
    return [float(c == s) for c, s in zip(completions, solution)]


def as_tensor(prompts, completions, **kwargs):
    """A reward returned as a tensor, as some users write them."""
    import torch

    return torch.tensor([float(len(c)) for c in completions])


class CountsItsCopies:
    """A reward whose every unpickling (one per copy sent to a worker) appends a line to `log_path`."""

    def __init__(self, log_path, payload_size=0):
        self.log_path, self.payload = log_path, "x" * payload_size

    def __setstate__(self, state):
        self.__dict__.update(state)
        with open(self.log_path, "a") as log:
            log.write("copy\n")

    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)


def always_raises(prompts, completions, **kwargs):
    """A reward whose service is down: every call raises."""
    raise TimeoutError("the reward service did not answer")


class BrokenRewardModel:
    """Scores all the completions in one call, as a reward model does (`batched`), and fails on every call, as one
    without a chat template fails on conversational prompts."""

    batched = True
    __name__ = "broken_rm"

    def __call__(self, prompts, completions, **kwargs):
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")


def needs_answer(completions, answer, **kwargs):
    """A reward that compares with the reference answer."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
