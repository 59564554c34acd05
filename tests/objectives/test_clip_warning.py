"""The clip-throttle warning: GSPO's mean clip/frac over its first N RL steps above train.clip_warning gives a
message naming the share, the range, the learning rate and the guidance; at or below it, before N steps, with the
warning off, or for a token-ratio objective (GRPO), none."""

import pytest

from gspo_lab.objectives import GRPO, GSPO, GSPOToken
from gspo_lab.objectives.clip_warning import clip_throttle


def history(fractions: list[float]) -> list[dict[str, float]]:
    """Logged rows as the module keeps them: an evaluation row at step 0 (no clip/frac), then one row per RL step."""
    return [{"step": 0, "eval/accuracy": 0.3}] + [{"step": s, "clip/frac": f} for s, f in enumerate(fractions)]


def test_a_gspo_run_clipping_more_than_the_threshold_is_told_why_and_where_to_read():
    message = clip_throttle(GSPO(), history([0.2, 0.3, 0.4]), threshold=0.2, steps=3, lr=1e-4)
    assert message.startswith("GSPO clipped 30% of its sequences on average over its first 3 RL steps")
    assert "[1 - 0.0003, 1 + 0.0004]" in message and "train.lr=0.0001" in message
    assert "clip_scale" in message and "The clip range and the learning rate" in message


@pytest.mark.parametrize("fractions, steps, threshold", [
    ([0.25, 0.25, 0.25], 3, 0.25),  # at the threshold (exact in binary): not above it
    ([0.5, 0.5], 3, 0.2),  # fewer steps logged than the window
    ([0.5, 0.5, 0.5], 3, None),  # train.clip_warning=null
])
def test_no_message_at_the_threshold_before_the_window_or_when_off(fractions, steps, threshold):
    assert clip_throttle(GSPO(), history(fractions), threshold, steps, lr=1e-4) is None


def test_only_the_first_steps_count():
    assert clip_throttle(GSPO(), history([0.1, 0.1, 0.9, 0.9]), threshold=0.2, steps=2, lr=1e-4) is None


def test_gspo_token_is_checked_and_grpo_which_clips_tokens_is_not():
    assert clip_throttle(GSPOToken(), history([0.5, 0.5]), threshold=0.2, steps=2, lr=1e-4).startswith("GSPOToken")
    assert clip_throttle(GRPO(), history([0.5, 0.5]), threshold=0.2, steps=2, lr=1e-4) is None
