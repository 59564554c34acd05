"""rollout.backend=vllm: completions from vLLM's `LLM`, colocated in this process, with the trainer's weights
pushed into it after every update (TRL's colocate mode, verl's hybrid engine).

The engine starts at the first rollout, on the device Lightning put the model on: vLLM builds the architecture
from the model's config with dummy weights (`load_format="dummy"`), and the first sync loads the trainer's. A
sync streams the trainer's parameters and persistent buffers (a router's selection bias) one at a time, named as
the checkpoint names them (transformers' weight conversions reverted: a MoE's fused expert banks split per
expert; a LoRA-wrapped weight merged; a sharded one gathered: gspo_lab.rollout.vllm.weights), through vLLM's
in-place reload (`reload_weights`: each layer's loaders, then its post-load processing),
and resets the prefix cache, whose keys and values the old weights computed. On CPU the post-load processing
repacks every Linear for its GEMM kernel, but not a MoE's expert banks, which `repack_cpu_experts` repacks.

Each row samples with its own seed (`SamplingParams(seed=...)`), so a row's tokens do not depend on the batch;
vLLM returns log softmax(logits / T) of each sampled token (`logprobs_mode="processed_logprobs"`: what the trainer
computes, as long as top-p is 1, which the plan checks). Its log-probs are the rollout's (`rollout_logp`:
mismatch/*, TIS/MIS); the old log-probs come from a trainer forward unless rollout.logprobs_from_generation=true.
For a MoE model the engine's worker captures the experts of every token it computes (gspo_lab.rollout.vllm.experts),
which routing.replay=r3 replays in the training forwards.

vLLM changes things in the process that hosts it: it sets torch to one thread and replaces
`torch.set_num_threads` (its CPU worker), and reseeds the global random generators. `start` puts all of them back.
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.backend import RunSettings, Sampling
from gspo_lab.rollout.completions import Completions, Generated, from_token_lists, stop_ids
from gspo_lab.rollout.sampling import draw_row_seeds
from gspo_lab.rollout.vllm import experts
from gspo_lab.rollout.vllm.calls import (
    engine_arguments,
    expert_count,
    generate_lists,
    saved_config,
)
from gspo_lab.rollout.vllm.experts import Captured
from gspo_lab.rollout.vllm.setup import (
    INSTALL,
    available,
    check,
    check_run,
    environment,
)
from gspo_lab.rollout.vllm.weights import (
    checkpoint_weights,
    quiet_reloads,
    reload_in_worker,
    save_adapter,
)
from gspo_lab.routing.engine_traces import trace_from_routed_experts
from gspo_lab.routing.trace import RoutingTrace


def refuse_scoring_temperature(temperature: float) -> None:
    """vLLM scores a prompt's tokens on its raw logits: at temperature 1 only (rollout.rescore=vllm)."""
    if temperature != 1:
        raise ValueError(f"rollout.rescore=vllm with rollout.temperature={temperature}: vLLM scores a prompt's tokens "
                         "on its raw logits, without the sampling temperature; use temperature 1 or rollout.rescore=hf")


@contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """The autocast that trainer.precision wraps the RL step in (bf16-mixed: torch.autocast(bfloat16)) turned off
    around the engine: a float32 or float16 engine computes in its own dtype, as the hf engine's copy does."""
    with torch.autocast(device_type, enabled=False):
        yield


@contextmanager
def host_state_kept() -> Iterator[None]:
    """Around vLLM's start: torch's thread count and `set_num_threads`, and the random generators of torch,
    Python and NumPy, as they were (vLLM's CPU worker sets one thread and disables `set_num_threads`; its worker
    reseeds every generator)."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextmanager
def trainer_group_kept(owned: bool) -> Iterator[None]:
    """Around vLLM's shutdown, which ends torch.distributed (`destroy_process_group()` of the default group): under
    DDP or FSDP2 that group is the trainer's, which still needs it (FSDP2's full state dict of the final model
    gathers through it), so it is kept unless vLLM started it (`owned`, one process)."""
    if owned:
        yield
        return
    destroy = torch.distributed.destroy_process_group

    def keep_default(group=None) -> None:
        if group is not None and group is not torch.distributed.GroupMember.WORLD:
            destroy(group)

    torch.distributed.destroy_process_group = keep_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def ranks_own_engine(device: torch.device) -> dict:
    """Under DDP, each rank's engine of its own (tensor parallel size 1) in the process group the trainer's ranks
    already hold (vLLM's `external_launcher`, as TRL's colocate mode), which reads the rank from the environment
    and takes the GPU numbered LOCAL_RANK: the trainer model's `device` (the GPU Lightning gave this rank, on any
    node)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    if torch.distributed.get_world_size() == 1:
        return {}
    os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
    os.environ["LOCAL_RANK"] = str(local_rank(device, torch.distributed.get_rank()))
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}


def local_rank(device: torch.device, rank: int) -> int:
    """The LOCAL_RANK vLLM's external launcher needs: the index of the trainer's GPU, whatever the node; on CPU
    (one node: `check` refuses more) the rank.

    >>> local_rank(torch.device("cuda", 1), rank=5), local_rank(torch.device("cpu"), rank=1)
    (1, 1)
    """
    return device.index if device.type == "cuda" else rank


class VLLMEngine:
    """rollout.backend=vllm (a `RolloutBackend`): vLLM's `LLM` in this process, generating with the trainer's
    current weights; evaluation generates through it too (eval.engine=rollout)."""

    name: ClassVar[str] = "vllm"
    continues_from_token_ids: ClassVar[bool] = True
    samples_synced_weights: ClassVar[bool] = True  # the engine holds the weights of its last sync
    returns_logprobs: ClassVar[bool] = True
    returns_experts: ClassVar[bool] = True  # captured in the engine's worker (gspo_lab.rollout.vllm.experts)
    serves_evaluation: ClassVar[bool] = True
    runs_apart: ClassVar[bool] = True  # gspo_lab.rollout.vllm.process (rollout.async_mode=overlap)

    def __init__(self, model: torch.nn.Module, rollout: RolloutConfig) -> None:
        if not available():
            raise ValueError(INSTALL)
        self.trainer_model, self.config = model, rollout.vllm
        self.llm = None
        self.adapter = None  # rollout.vllm.lora_sync=adapter: the LoRARequest the engine serves (after a first sync)
        self.moe_layers = 0  # MoE layers whose experts the engine captures (gspo_lab.rollout.vllm.experts)
        self.captured = Captured()  # the sequences computed since the last sync, with their experts
        self.folder: tempfile.TemporaryDirectory | None = None  # the config vLLM builds the model from
        self.owns_process_group = False  # vLLM initialised torch.distributed (one process) and ends it on close

    @classmethod
    def check(cls, run: RunSettings) -> None:
        """What vLLM cannot run here (`setup.check`) and what the run's other settings ask of it
        (`setup.check_run`)."""
        source = run.model_source
        check(run.rollout, source.skeleton(), run.device, source.lora, run.nodes)
        check_run(run.rollout, run.evaluation, run.train, source)

    @classmethod
    def exact_logprobs(cls, rollout: RolloutConfig) -> bool:
        """Another implementation's: π_old comes from a trainer forward unless rollout.logprobs_from_generation."""
        return False

    @classmethod
    def check_scoring(cls, rollout: RolloutConfig) -> None:
        """vLLM's prompt log-probs skip the sampler, and so its temperature."""
        refuse_scoring_temperature(rollout.temperature)

    @property
    def model(self) -> torch.nn.Module:
        """The trainer's model (vLLM's own lives in its worker)."""
        return self.trainer_model

    @property
    def dtype(self) -> str:
        """The engine's dtype: rollout.vllm.dtype, or the trainer model's."""
        return self.config.dtype or str(next(self.trainer_model.parameters()).dtype).removeprefix("torch.")

    @property
    def device_type(self) -> str:
        """Where the trainer's model, and so the engine, runs: "cpu" or "cuda"."""
        return next(self.trainer_model.parameters()).device.type

    @property
    def adapter_rank(self) -> int | None:
        """The LoRA rank vLLM serves under rollout.vllm.lora_sync=adapter; None where it syncs merged weights."""
        if self.config.lora_sync != "adapter":
            return None
        return self.trainer_model.peft_config["default"].r

    def start(self) -> None:
        """Build the engine from the model's config, with dummy weights until the first sync."""
        environment()
        from vllm import LLM

        self.folder = saved_config(self.trainer_model)
        self.owns_process_group = not torch.distributed.is_initialized()
        with host_state_kept(), autocast_off(self.device_type):
            self.llm = LLM(**ranks_own_engine(next(self.trainer_model.parameters()).device),
                           **engine_arguments(self.folder.name, self.dtype, self.device_type, self.config,
                                              self.adapter_rank))
        quiet_reloads()  # vLLM has configured its loggers by now
        self.moe_layers = self.llm.collective_rpc(experts.install)[0]

    def close(self) -> None:
        """Stop the engine and tear down vLLM's process groups (another engine in this process, the next job of a
        multirun, builds its own); the trainer's process group, under DDP, stays."""
        if self.llm is None:
            return
        from vllm.distributed import parallel_state

        with trainer_group_kept(self.owns_process_group):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm, self.adapter = None, None
        parallel_state.destroy_model_parallel()
        if self.owns_process_group:
            parallel_state.destroy_distributed_environment()
        gc.collect()
        self.folder.cleanup()

    @torch.no_grad()
    def sync(self) -> None:
        """Push the trainer's current weights into the engine (started on the first call) and reset its prefix
        cache. Always: a fused optimizer step changes the weights without bumping their version counters."""
        if self.llm is None:
            self.start()
        with autocast_off(self.device_type):
            if self.adapter_rank is None:
                self.llm.collective_rpc(reload_in_worker, args=(checkpoint_weights(self.trainer_model),))
            else:
                self.sync_adapter()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight sync (requests still running?): its "
                               "cached keys and values are the old weights', and the next rollout would reuse them")
        if self.moe_layers:  # the cache is empty: no sequence's experts can be reused
            self.captured.reset()
            self.llm.collective_rpc(experts.install)  # the routers of the reloaded model capture

    def sync_adapter(self) -> None:
        """rollout.vllm.lora_sync=adapter: the base weights at the first sync (they are frozen), then the adapters
        alone, saved in PEFT's format and loaded in place of the last ones (one adapter id, `load_inplace`)."""
        from vllm.lora.request import LoRARequest

        if self.adapter is None:
            self.llm.collective_rpc(reload_in_worker, args=(checkpoint_weights(self.trainer_model, merged=False),))
        folder = Path(self.folder.name) / "adapter"
        save_adapter(self.trainer_model, folder)
        self.llm.llm_engine.add_lora(LoRARequest("policy", 1, str(folder), load_inplace=True))
        self.adapter = LoRARequest("policy", 1, str(folder))

    def generate(self, tokenizer, prompts: list[str] | list[list[int]], sampling: Sampling,
                 row_seeds: Tensor | None = None,
                 routing=None) -> Generated:
        """The backend's contract (gspo_lab.rollout.backend) on vLLM, with the weights of the last `sync`: one
        completion per prompt, row n seeded by `row_seeds[n]` (greedy: none), cut at the stop ids as the hf
        backend cuts them (`stop_ids`), with the engine's log-probs of the sampled tokens and, for a MoE model
        where `routing` is given, the experts it routed each prompt and completion token to (captured in its
        worker: gspo_lab.rollout.vllm.experts) as the routing trace. Each group's prompt is prefilled once by the
        prefix cache, whatever `sampling.share_prompts`. `suppress_eos` (benchmarks): every completion runs to
        max_new_tokens; a stop token may be sampled, and does not stop it (hf never samples one), so the
        distribution and its log-probs stay the trainer's."""
        stop = [] if sampling.suppress_eos else stop_ids(tokenizer, self.trainer_model, sampling.stop_token_ids)
        encoded = ([list(ids) for ids in prompts] if prompts and not isinstance(prompts[0], str) else
                   tokenizer(prompts, add_special_tokens=sampling.add_special_tokens)["input_ids"])
        seeds = [None] * len(prompts) if sampling.greedy else (row_seeds if row_seeds is not None else
                                                                 draw_row_seeds(len(prompts))).tolist()
        with autocast_off(self.device_type):
            outputs, tokens, logprobs = generate_lists(self.llm, encoded, sampling, seeds, stop, self.adapter)
        completions = from_token_lists(tokenizer, encoded, tokens, logprobs, stop)
        routed = self.routed_experts(outputs, encoded, tokens)
        if routing is None or not routing.moe:
            return Generated(completions)
        return Generated(completions, self.trace(routed, completions))

    def routed_experts(self, outputs: list, encoded: list[list[int]], tokens: list[list[int]]) -> list[np.ndarray]:
        """The experts [p + c - 1, M, k] the engine routed each row's prompt and completion tokens to (every token
        fed to it: the last sampled one never is); [] for a dense model."""
        if not self.moe_layers:
            return []
        taken = self.llm.collective_rpc(experts.take)[0]
        return self.captured.experts(taken, [(output.request_id, prompt + sampled[:-1])
                                             for output, prompt, sampled in zip(outputs, encoded, tokens)])

    def trace(self, routed: list[np.ndarray], completions: Completions) -> RoutingTrace:
        """The rows' experts as a routing trace over the batch's columns (left-padded prompts, then completions)."""
        prompt_lens = completions.prompt_mask.sum(-1).tolist()
        kept = completions.completion_mask.sum(-1).tolist()  # a completion cut at a stop token keeps fewer
        rows = [row[: p + c - 1] for row, p, c in zip(routed, prompt_lens, kept)]
        prompt_len = completions.prompt_ids.shape[1]
        length = prompt_len + completions.completion_ids.shape[1]
        return trace_from_routed_experts(rows, prompt_lens, prompt_len, length, expert_count(self.trainer_model))

    def score(self, tokenizer, completions: Completions, temperature: float) -> Tensor:
        """vLLM's log-probs [N, C] of the completion tokens under the engine's current weights: its prompt log-probs
        of prompt + completion (one prefill each; rollout.rescore). Those skip the sampler, so they are log
        softmax(logits) at temperature 1 only."""
        from vllm import SamplingParams

        refuse_scoring_temperature(temperature)
        rows = []
        for prompt, keep, completion, length in zip(completions.prompt_ids.tolist(), completions.prompt_mask.tolist(),
                                                    completions.completion_ids.tolist(),
                                                    completions.completion_mask.sum(-1).tolist()):
            rows.append([t for t, k in zip(prompt, keep) if k] + completion[:length])
        params = SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        with autocast_off(self.device_type):
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in rows], params, use_tqdm=False,
                                        lora_request=self.adapter)
        self.routed_experts(outputs, rows, [[output.outputs[0].token_ids[0]] for output in outputs])  # fills the cache
        scores = torch.zeros(completions.completion_ids.shape)  # [N, C]
        for row, (ids, output, length) in enumerate(zip(rows, outputs, completions.completion_mask.sum(-1).tolist())):
            positions = output.prompt_logprobs[len(ids) - length:]  # position i: {token id: Logprob} of token i
            scores[row, :length] = torch.tensor([step[token].logprob for step, token in
                                                 zip(positions, ids[len(ids) - length:])])
        return scores
