"""The rule that stops a run whose failures leave it training on nothing (train.failure_stop_frac).

One flaky call costs a counted failure: a reward function that raises or times out scores 0 for that completion
(reward/<name>/errors, /timeouts), a row whose environment failed is not trained on (tools/lost_frac), and the
first of each is logged with its text and traceback. A round of a step in which one reward function failed on at
least `failure_stop_frac` of the completions, or that share of the rows lost their environment, stops the run
before the step's update (`NoSignal`, which gspo-train reports with exit code 1), with the first error's message and
traceback and a checkpoint of the weights before the step. The default, 1.0, stops where a function failed on every
completion (the step would train on zeros in its place) or every environment was lost. Ranks decide together.
"""

from __future__ import annotations

from gspo_lab.rewards import Scores
from gspo_lab.rollout.completions import Generated
from gspo_lab.step.ranks import Ranks


class RunStopped(RuntimeError):
    """A failure the run cannot train through; gspo-train prints the message and exits with code 1."""


class NoSignal(RunStopped):
    """A round's reward functions or environments failed on `train.failure_stop_frac` of its completions or more."""


def failure_reasons(scores: Scores, generated: Generated, stop_frac: float, first_errors: dict[str, str],
                    keys: dict[str, str]) -> list[str]:
    """Why this rank's round has too little signal left: each reward function (named with its config key, `keys`)
    that failed on `stop_frac` of the completions or more, and the rows that lost their environment, each with
    its first error; [] where the round can train.

    >>> from gspo_lab.rewards import Failures
    >>> import torch
    >>> scores = Scores(torch.zeros(4), torch.ones(4, dtype=torch.bool), {}, failures={"rm": Failures(4, "boom")})
    >>> failure_reasons(scores, None, 1.0, {}, {"rm": "reward.functions.0"})
    ['reward function rm (reward.functions.0) failed on 4 of 4 completions; the first: boom']
    >>> scores.total = torch.zeros(5)  # 4 of 5 failed: the fifth still scored
    >>> failure_reasons(scores, None, 1.0, {}, {"rm": "reward.functions.0"})
    []
    """
    n = len(scores.total)
    reasons = [f"reward function {name} ({keys.get(name, 'reward.functions')}) failed on {failed.count} of {n} "
               f"completions; the first: {failed.first}"
               for name, failed in scores.failures.items() if n and failed.count >= stop_frac * n]
    lost = generated.extra.get("lost") if generated is not None else None
    if lost is not None and n and int(lost.sum()) >= stop_frac * n:
        first = first_errors.get("reset") or first_errors.get("lost") or "no error was reported"
        reasons.append(f"{int(lost.sum())} of {n} rows lost their environment (task.environment); the first: {first}")
    return reasons


def stop_without_signal(reasons: list[str], ranks: Ranks, step: int, stop_frac: float) -> None:
    """Raise NoSignal on every rank where any rank has `reasons` (collective: every rank calls it each round)."""
    if not ranks.any(bool(reasons)):
        return
    why = "\n".join(reasons) if reasons else "another rank's round failed (its log has the error)"
    raise NoSignal(f"RL step {step}: too many failures to train on (train.failure_stop_frac={stop_frac}); stopped "
                   f"before the step's update.\n{why}")
