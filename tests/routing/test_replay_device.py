"""Routing replay never makes the host wait for the device inside a forward: a mini-batch's trace goes to the
model's device once per replay context, not once per MoE layer, and the override counts stay there until the
step's metrics read them (one read). Counted on CPU by wrapping the tensor methods that copy to the host (on a
GPU, a wait for every kernel queued before) or to a device, for calls made from gspo_lab/routing."""

import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gspo_lab.routing
from gspo_lab.rollout import generate, token_logprobs
from gspo_lab.routing import RoutingReplay, record_routing, replay_routing

ROUTING_CODE = str(Path(gspo_lab.routing.__file__).parent)
HOST_READS = ("cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__")
DEVICE_COPIES = ("to", "cuda")
PROMPTS = ["123+456=", "1+2=", "77+8=", "500+500="] * 2  # two rows per prompt: shared prompts have views


def names_a_device(args, kwargs) -> bool:
    """Whether Tensor.to(*args, **kwargs) may copy to another device (not a dtype change alone)."""
    return "device" in kwargs or any(isinstance(a, (torch.device, str, int, torch.Tensor)) for a in args)


@contextmanager
def transfers(monkeypatch):
    """Counts by method name the host reads and device copies that gspo_lab/routing's code asks for."""
    counts = Counter()

    def counted(name, method):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(ROUTING_CODE) and (name in HOST_READS or names_a_device(args, kwargs)):
                counts[name] += 1
            return method(self, *args, **kwargs)
        return wrapper

    with monkeypatch.context() as patch:
        for name in HOST_READS + DEVICE_COPIES:
            patch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        yield counts


def rollout(model, tokenizer):
    """A batch of prompts and sampled completions, and the experts the model chose for it."""
    torch.manual_seed(1)
    out = generate(model, tokenizer, PROMPTS, 6)
    ids, mask = torch.cat([out.prompt_ids, out.completion_ids], 1), torch.cat([out.prompt_mask, out.completion_mask], 1)
    C = out.completion_ids.shape[1]
    with torch.no_grad(), record_routing(model) as trace:
        token_logprobs(model, ids, mask, C)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))  # an update: replay overrides some choices
    return ids, mask, C, trace


@pytest.mark.parametrize("checkpointing, share_prompts", [(False, False), (True, False), (False, True)])
def test_a_replayed_forward_and_backward_read_nothing_back_in_any_layer(checkpointing, share_prompts, tiny_family,
                                                                        monkeypatch):
    """Before: per layer, the trace slice copied to the device twice and the counts read back three times."""
    model, tokenizer = tiny_family("tiny_moe", gradient_checkpointing=checkpointing)
    ids, mask, C, trace = rollout(model, tokenizer)
    model.train()  # activation checkpointing recomputes each block in the backward, under the hooks again
    with transfers(monkeypatch) as inside, replay_routing(model, trace, mask) as stats:
        logp, _ = token_logprobs(model, ids, mask, C, share_prompts=share_prompts)
        logp.sum().backward()
    assert not any(inside[name] for name in HOST_READS), inside
    assert sum(inside.values()) <= 2, inside  # the rows of a shared-prompt view (for the trace, for valid)
    with transfers(monkeypatch) as reading:
        override_frac = stats.override_frac
    assert dict(reading) == {"tolist": 1}  # the metrics read: the one wait
    assert 0 < override_frac < 1


def test_override_counts_add_up_on_the_device_over_mini_batches(tiny_family, monkeypatch):
    model, tokenizer = tiny_family("tiny_moe")
    ids, mask, C, trace = rollout(model, tokenizer)
    replay = RoutingReplay(model, "r3")
    minibatches = [SimpleNamespace(rows=rows, routing_trace=trace.rows(rows), attention_mask=mask[rows])
                   for rows in (torch.arange(0, 4), torch.arange(4, 8))]
    with transfers(monkeypatch) as inside:
        for minibatch in minibatches:
            with replay.training(minibatch):
                logp, _ = token_logprobs(model, ids[minibatch.rows], minibatch.attention_mask, C)
                logp.sum().backward()
    assert not any(inside[name] for name in HOST_READS), inside
    overridden = replayed = 0
    for minibatch in minibatches:  # the same forwards again, each read on its own
        with replay_routing(model, minibatch.routing_trace, minibatch.attention_mask) as stats:
            token_logprobs(model, ids[minibatch.rows], minibatch.attention_mask, C)
        overridden, replayed = overridden + int(stats.overridden), replayed + int(stats.replayed)
    assert overridden > 0 and replay._stats.override_frac == overridden / replayed
