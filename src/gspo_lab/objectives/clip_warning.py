"""The clip-throttle warning. A sequence-ratio objective (GSPO, GSPO-token, LUSPO: one ratio per sequence, clipped
per sequence) that clips more than `train.clip_warning` of its sequences on average over its first
`train.clip_warning_steps` RL steps is held back by its clip range at this learning rate: in experiments/clip_lr a
tenfold wider range learned more wherever the early clip fraction was that high. The message says so and where the
guidance is. Token-ratio objectives (GRPO) clip a share of tokens, a different quantity; they are not checked."""

from __future__ import annotations

from gspo_lab.objectives.ratios import SequenceRatio, SequenceTokenRatio

GUIDANCE = "docs/concepts/objectives.md, section 'The clip range and the learning rate'"


def clips_sequences(objective) -> bool:
    """Whether `objective`'s clip/frac counts whole sequences (its ratio is one per sequence)."""
    return isinstance(getattr(objective, "ratio", None), (SequenceRatio, SequenceTokenRatio))


def clip_throttle(objective, history: list[dict[str, float]], threshold: float | None, steps: int,
                  lr: float) -> str | None:
    """The warning's text when the mean clip/frac of RL steps 0 .. steps - 1 in `history` (the module's logged
    rows) is above `threshold`; None below it, before `steps` steps are logged, with threshold None, or for an
    objective that clips tokens."""
    if threshold is None or not clips_sequences(objective):
        return None
    fractions = [row["clip/frac"] for row in history if "clip/frac" in row and row["step"] < steps]
    if len(fractions) < steps:
        return None
    mean = sum(fractions) / len(fractions)
    if mean <= threshold:
        return None
    surrogate = getattr(objective, "surrogate", None)
    bounds = (f" [1 - {surrogate.clip_low:g}, 1 + {surrogate.clip_high:g}]"
              if hasattr(surrogate, "clip_low") and hasattr(surrogate, "clip_high") else "")
    return (f"{objective.label} clipped {mean:.0%} of its sequences on average over its first {steps} RL steps, more "
            f"than train.clip_warning={threshold:g}: its clip range{bounds} holds back learning at train.lr={lr:g}. "
            f"Widen it with clip_scale (the paper's range times it; experiments/clip_lr) or lower train.lr; see "
            f"{GUIDANCE}. train.clip_warning=null silences this.")
