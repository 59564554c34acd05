"""What float arithmetic guarantees when a test compares two computations of the same numbers.

Bitwise equality holds only where the same operations run on the same shapes in the same process: the same
kernels, thread count and reduction order. A test asserting it says so in a comment. Anywhere else the two
differ by rounding, and by how much depends on the machine: PyTorch picks its CPU kernels by
ATEN_CPU_CAPABILITY (default, avx2, avx512) and blocks GEMMs by shape, and thread counts change reduction
orders. So a 2-row and a 4-row batch, a chunked and a whole log_softmax, or one process and two ranks agree to
a few units of rounding of the numbers the error grows from, not bit for bit.

`rounding_tolerance` states that bound: `units` x the dtype's eps x `scale`, the magnitude the error scales
with. For log-probs that is the size of the logits / T and of their logsumexp (`logit_scale`), not the
log-prob itself: log_softmax's error is at most twice the largest error of its inputs (|d log_softmax(z)_i| <=
|dz_i| + max_j |dz_j|), and a logit's rounding error is relative to the logits, so a log-prob near 0 inherits
the error of logits near 100. `units` counts the
roundings that can differ: a reduction of K terms summed in another order differs by up to about sqrt(K)
roundings in practice (K in the worst case), times the layers it passes through.

The tests marked `numerics` are the ones whose assertions depend on this; `.ci/run` runs them again under a
second ATEN_CPU_CAPABILITY and with one thread, so an assertion that holds on one CPU only fails in CI.
"""

from __future__ import annotations

import math

import torch


def rounding_tolerance(scale: float | torch.Tensor, dtype: torch.dtype = torch.float32, units: float = 16.0) -> float:
    """`units` roundings of `dtype` at magnitude `scale`.

    >>> rounding_tolerance(100.0, units=16)  # float32: eps = 2^-23 ~ 1.19e-7
    0.00019073486328125
    >>> rounding_tolerance(1.0, torch.bfloat16, units=1)
    0.0078125
    """
    return float(units * torch.finfo(dtype).eps * float(scale))


def logit_scale(logits: torch.Tensor, temperature: float = 1.0) -> float:
    """The magnitude a log-prob's rounding error grows from: log_softmax(z) = z - logsumexp(z) rounds at the size
    of its inputs z = logits / T and of logsumexp(z), which is at most max z + log V (V: the vocabulary)."""
    z = logits.detach().abs().max() / temperature
    return float(z + math.log(logits.shape[-1]))


def assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor, scale: float, units: float = 16.0,
                          dtype: torch.dtype = torch.float32) -> None:
    """|actual - expected| <= rounding_tolerance(scale, dtype, units) everywhere, with the largest difference
    and the bound in the message."""
    bound = rounding_tolerance(scale, dtype, units)
    worst = float((actual.double() - expected.double()).abs().max()) if actual.numel() else 0.0
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert worst <= bound, f"largest difference {worst:.3g} > {units} x eps({dtype}) x {scale:.3g} = {bound:.3g}"


# An on-policy ratio exp(mean_t (log π - log π_old)) from two computations of the same log-probs (generation's
# step-by-step logits and a training forward): the tiny models' log-probs (|z / T| + log V up to about 10) agree to
# 8 roundings, so |ratio - 1| <= 8 x eps x 10 = 9.5e-6.
RATIO_ROUNDING = rounding_tolerance(10.0, units=8)
