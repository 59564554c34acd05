"""record_routing and replay_routing: context managers that hook every router instance of one model.

The hooks live on the model's own router modules for the duration of the context and are removed on exit;
nothing is stored on classes or in globals, so two models (or two runs in one process) never interfere. The one
piece of shared state is a context variable set around a single decoder call (`call_view`): when prompts are
computed once per group, it tells recorders and replay which rows and columns of the batch that call covers.

    with record_routing(model) as trace:          # any forward or generate call
        model.generate(**batch)
    with replay_routing(model, trace) as stats:   # routers use the recorded experts
        loss = policy_loss(model(...)); loss.backward()   # keep backward inside under gradient checkpointing
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
from torch import Tensor

from gspo_lab.decoder import decoder_of
from gspo_lab.routing.adapters import find_routers
from gspo_lab.routing.trace import RoutingTrace, compact_dtype


@dataclass(frozen=True)
class CallView:
    """Which part of a [B, L] batch one decoder call covers, when prompts are computed once per group
    (gspo_lab.rollout.logprobs.shared_prompt_hidden, gspo_lab.rollout.generation.prefill_distinct_prompts).

    columns: the batch columns the call covers.
    rows: [U] the batch row each call row stands for (replay reads those rows of its trace); None: every row.
    expand: [B] the call row of each batch row (a recorder stores the call's experts for every batch row, so its
        trace stays [B, L]); None: the call's rows are the batch's.
    packing: a padding-free call over the batch's real tokens in bins (gspo_lab.rollout.packing.Packing): a
        recorder stores its experts back in the [B, L] layout, replay reads the trace in the bins' layout.
    """

    columns: slice
    rows: Tensor | None = None
    expand: Tensor | None = None
    packing: Any = None


_CALL_VIEW: ContextVar[CallView | None] = ContextVar("call_view", default=None)


@contextmanager
def call_view(view: CallView) -> Iterator[None]:
    """Around a decoder call that covers `view` of the batch rather than all of it."""
    token = _CALL_VIEW.set(view)
    try:
        yield
    finally:
        _CALL_VIEW.reset(token)


class DecoderCall(NamedTuple):
    """A decoder call as its routers' hooks see it: its [rows, length] tokens and the `CallView` open when it was
    made. A block recomputed in the backward (activation checkpointing) runs outside that context, so hooks read
    the view kept here, the last decoder call's, which is the one recomputed."""

    rows: int
    length: int
    view: CallView | None


def _decoder_call(args, kwargs) -> DecoderCall:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *(a for a in args if isinstance(a, Tensor))):
        if value is not None:
            return DecoderCall(value.shape[0], value.shape[1], _CALL_VIEW.get())
    raise ValueError("routing hooks: the decoder was called without input_ids or inputs_embeds")


@contextmanager
def router_hooks(model: torch.nn.Module, router_hook, purpose: str) -> Iterator[list[DecoderCall]]:
    """Registers `router_hook(layer, router, adapter, hidden, output, call)` on every router (`hidden`: the
    router's first positional input, as every supported family calls it; `call`: the `DecoderCall` it belongs to);
    yields the list of the decoder calls made inside the context."""
    routers = find_routers(model, purpose)
    decoder = decoder_of(model)
    shapes: list[DecoderCall] = []
    handles = [decoder.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(_decoder_call(args, kwargs)), with_kwargs=True)]
    for layer, (_, router, adapter) in enumerate(routers):
        handles.append(router.register_forward_hook(
            lambda module, args, output, layer=layer, adapter=adapter: router_hook(layer, module, adapter, args[0], output,
                                                                                   shapes[-1])
        ))
    try:
        yield shapes
    finally:
        for handle in handles:
            handle.remove()


class _Recorder:
    """Collects each layer's [B, S, k] choices per decoder call, then stitches them along the sequence. They stay
    on the model's device until the end: a copy to the CPU in every layer of every decode step would make the
    host wait for the GPU there, about 1,500 times per generation of the bench_gpu workload."""

    def __init__(self, num_layers: int) -> None:
        self.calls: list[list[Tensor]] = [[] for _ in range(num_layers)]

    def __call__(self, layer, router, adapter, hidden, output, call: DecoderCall) -> None:
        _, indices = adapter.choice(router, output)
        indices = indices.detach().to(compact_dtype(router.num_experts)).reshape(call.rows, call.length, -1)
        view = call.view
        if view is not None and view.packing is not None:  # [R, W, k] bins -> [B, L, k]; padding: expert 0
            self.calls[layer].append(view.packing.unpacked(indices))
            return
        expand = None if view is None or view.expand is None else view.expand.to(indices.device)
        self.calls[layer].append(indices if expand is None else indices[expand])  # [B, length, k]

    def trace(self, prompt_len: int | None) -> RoutingTrace:
        if not self.calls[0]:
            raise ValueError("record_routing: no forward pass ran inside the context, so nothing was recorded")
        indices = torch.stack([torch.cat(calls, dim=1) for calls in self.calls]).cpu()  # [layers, B, L, k]
        recorded = torch.ones(indices.shape[1:3], dtype=torch.bool)
        return RoutingTrace(indices, recorded, prompt_len)


@contextmanager
def record_routing(model: torch.nn.Module, prompt_len: int | None = None) -> Iterator[RoutingTrace]:
    """Yields a trace filled with the top-k experts of every MoE layer for every token that the decoder
    processes inside the context (a forward over [B, L], or generate's prefill and each decode step)."""
    recorder = _Recorder(len(find_routers(model, "record_routing")))
    trace = RoutingTrace(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.bool), prompt_len)
    with router_hooks(model, recorder, "record_routing"):
        yield trace
    finished = recorder.trace(prompt_len)
    trace.indices, trace.recorded = finished.indices, finished.recorded


@dataclass
class ReplayStats:
    """How often replay overrode the router's own choice: (token, layer) pairs whose expert set differed. The
    counts stay on the model's device, as tensors once a layer has counted, until `override_frac` reads them:
    reading them in every MoE layer would make the host wait for the GPU there."""

    overridden: Tensor | int = 0
    replayed: Tensor | int = 0

    @property
    def override_frac(self) -> float:
        """The fraction, copied from the device once."""
        overridden, replayed = torch.stack([torch.as_tensor(self.overridden), torch.as_tensor(self.replayed)]).tolist()
        return overridden / replayed if replayed else 0.0


class _Replayer:
    """The hook of replay_routing. The trace and `valid` are copied to the routers' device once, at the first
    MoE layer, and cut to a decoder call's rows and columns once per call, so each layer takes its slice on the
    device: no copy between host and device, and no wait for one, in any layer."""

    def __init__(self, trace: RoutingTrace, valid: Tensor | None) -> None:
        self.trace, self.valid = trace, valid
        self.stats = ReplayStats()
        self._call: tuple[CallView, RoutingTrace, Tensor | None] | None = None  # the view in use and its cut

    def _seen(self, device: torch.device, view: CallView | None) -> tuple[RoutingTrace, Tensor | None]:
        """The trace and valid [B', L'] of the decoder call with this `view`, on `device`."""
        if self.trace.indices.device != device:
            self.trace, self._call = self.trace.to(device), None
            self.valid = None if self.valid is None else self.valid.to(device)
        if view is None:  # else a call over distinct prompts, the completion columns only, or packed rows
            return self.trace, self.valid
        if self._call is None or self._call[0] is not view:
            if view.packing is not None:  # the trace in the bins' layout; the slack is not recorded
                packing = view.packing
                valid = None if self.valid is None else packing.packed(self.valid, False)
                seen = RoutingTrace(torch.stack([packing.packed(layer) for layer in self.trace.indices]),
                                    packing.packed(self.trace.recorded, False))
                self._call = (view, seen, valid)
            else:
                valid = None if self.valid is None else _viewed(self.valid, view)
                self._call = (view, self.trace.view(view.rows, view.columns), valid)
        return self._call[1:]

    def __call__(self, layer, router, adapter, hidden, output, call: DecoderCall):
        _, natural = adapter.choice(router, output)
        seen, mask = self._seen(natural.device, call.view)
        recorded_idx, recorded = seen.layer(layer, call.rows, call.length)  # [N, k], [N]
        indices = torch.where(recorded[:, None], recorded_idx.to(natural.dtype), natural)  # [N, k]
        with torch.no_grad():
            counted = recorded if mask is None else recorded & mask.reshape(-1)
            differs = (natural.sort(-1).values != indices.sort(-1).values).any(-1) & counted
            self.stats.overridden = self.stats.overridden + differs.sum()  # on the device: no wait here
            self.stats.replayed = self.stats.replayed + counted.sum()
        return adapter.replayed(router, hidden, output, indices)


@contextmanager
def replay_routing(model: torch.nn.Module, trace: RoutingTrace, valid: Tensor | None = None) -> Iterator[ReplayStats]:
    """Every MoE layer uses the experts recorded in `trace` (positions not recorded keep their own choice);
    gate weights are recomputed from the live logits at those experts. `valid` [B, L] limits the override
    statistics to real tokens. Every forward inside must cover the trace's [B, L] tokens."""
    replayer = _Replayer(trace, None if valid is None else valid.bool())
    with router_hooks(model, replayer, "replay_routing"):
        yield replayer.stats


def _viewed(valid: Tensor, view: CallView) -> Tensor:
    """valid [B, L] restricted to the rows and columns a call covers."""
    rows = valid if view.rows is None else valid[view.rows.to(valid.device)]
    return rows[:, view.columns]
