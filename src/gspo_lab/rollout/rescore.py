"""rollout.rescore: the sampled tokens scored again by a second engine, whose log-probs then stand for the generating
engine's (`rollout_logp`: mismatch/*, TIS/MIS; π_old under rollout.logprobs_from_generation=true). A diagnostic
that separates an engine's samples from its log-probs (experiments/real_engine, issue 50): vLLM's samples trained
on the simulated bf16 engine's π_old, and the converse.

    rollout.rescore=hf    a forward of the hf backend's engine (rollout.engine.*: a bf16 copy of the weights, ...)
    rollout.rescore=vllm  vLLM's prompt log-probs of prompt + completion (rollout.vllm.*; temperature 1 only: vLLM
                          scores a prompt's tokens on its raw logits, skipping the sampler's temperature)

A backend scores as a `Scorer` (gspo_lab.rollout.backend): `score(tokenizer, completions, temperature)`: the log-probs [N, C] of the completion tokens
(0 on padding) under its current weights, in one forward (a prefill), where generation computed them one token at
a time with a KV cache. Where rollout.rescore names the generating backend itself, that same engine scores its
own samples: the gap between its prefill and its decode log-probs. Logged: rescore/logp_abs_diff (mean |rescored -
generated| per token) and rescore/seq_log_ratio_abs (mean over rows of |the per-token mean of that difference|, the
sequence log-ratio GSPO's clip sees).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.backend import RolloutBackend, build_backend
from gspo_lab.rollout.completions import Generated


class Rescorer:
    """The engine of rollout.rescore, synced beside the generating backend, that scores its samples."""

    def __init__(self, engine: RolloutBackend, own: bool, temperature: float) -> None:
        self.engine, self.own, self.temperature = engine, own, temperature  # own: an engine of its own, not the backend

    def sync(self) -> None:
        """The trainer's current weights (the backend's own sync already did this for a shared engine)."""
        if self.own:
            self.engine.sync()

    def close(self) -> None:
        if self.own:
            self.engine.close()

    def rescored(self, tokenizer, generated: Generated) -> tuple[Generated, dict[str, float]]:
        """`generated` with its completions' log-probs replaced by this engine's scores of the same tokens, and
        how far they moved."""
        started = time.perf_counter()
        completions = generated.completions
        with torch.no_grad():
            scores = self.engine.score(tokenizer, completions, self.temperature).to(completions.completion_ids.device)
        mask = completions.completion_mask.to(scores.dtype)  # [N, C]
        scores = scores * mask
        metrics = {"time/rescore_s": time.perf_counter() - started}
        if completions.logprobs is not None:
            diff = (scores - completions.logprobs.to(scores.dtype)) * mask  # [N, C]
            tokens = mask.sum(-1).clamp(min=1)  # [N]
            metrics["rescore/logp_abs_diff"] = (diff.abs().sum() / mask.sum().clamp(min=1)).item()
            metrics["rescore/seq_log_ratio_abs"] = (diff.sum(-1) / tokens).abs().mean().item()
        return replace(generated, completions=replace(completions, logprobs=scores)), metrics


def build_rescorer(model: torch.nn.Module, rollout: RolloutConfig, backend: RolloutBackend) -> Rescorer | None:
    """rollout.rescore's engine (None where it is null): the generating backend itself where it names that backend,
    else one of its own on `model`'s weights."""
    if rollout.rescore is None:
        return None
    if rollout.rescore == rollout.backend:
        return Rescorer(backend, own=False, temperature=rollout.temperature)
    return Rescorer(build_backend(model, replace(rollout, backend=rollout.rescore)), own=True,
                    temperature=rollout.temperature)

