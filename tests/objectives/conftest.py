"""The random objective inputs the objective tests share."""

import pytest
import torch


def make_random_batch(B=5, T=7, seed=0, dtype=torch.float64, spread=0.3):
    """logp, old_logp [B, T] (log-probs spread around each other by `spread`), advantages [B], mask [B, T] with
    about 30% padding and every row's first token valid."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logp = old + spread * torch.randn(B, T, generator=g, dtype=dtype)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1
    adv = torch.randn(B, generator=g, dtype=dtype)
    return logp, old, adv, mask


@pytest.fixture(scope="session")
def random_batch():
    """random_batch(B=5, T=7, seed=0, dtype=float64, spread=0.3) -> (logp, old_logp, advantages, mask)."""
    return make_random_batch
