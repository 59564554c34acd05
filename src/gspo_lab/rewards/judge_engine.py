"""reward=judge with `backend: vllm`: the judge served by a vLLM engine of its own, in a process of its own.

The policy's engine (rollout.backend=vllm) lives in the training process with vLLM's process groups, so the judge's
engine gets a spawned process (as verl's reward loop and ROLL's judge worker serve a judge apart from the policy):
vLLM with the judge's own weights (its save_pretrained folder), never synced, on the training process's cores on
CPU (grading and training take turns) or beside the trainer on its GPU (`vllm.gpu_memory_utilization`). It takes
token ids and returns token ids or log-probs; the judge's tokenizer stays in the training process
(gspo_lab.rewards.judge renders and parses), so vLLM starts without one.

- **verdict log-probs** (mode=logprob): grading prompt + each verdict's first token as a prompt of its own, scored by
  vLLM's prompt log-probs (log softmax of the raw logits at the last position, what the hf judge reads): two
  prefills per completion, one log-prob returned for each, whatever the vocabulary's size.
- **answers** (mode=output): greedy, up to `max_new_tokens`, stopped at the judge's end-of-sequence token.

Started at the first grading call, stopped by the run's close (WeightedRewards.close) or when the training process
is gone.
"""

from __future__ import annotations

import os
import queue
import signal
import traceback
from dataclasses import dataclass

from gspo_lab.engine_settings import VLLMConfig
from gspo_lab.rollout.vllm.process import POLL_S, awaited, stopped


@dataclass(frozen=True)
class JudgeSpec:
    """What the judge's engine process needs: the judge's folder, dtype and vLLM settings, the trainer's pid."""

    path: str
    dtype: str
    vllm: VLLMConfig
    device_type: str  # "cpu" or "cuda"
    parent: int
    timeout_s: float


class JudgeEngine:
    """The training process's handle on the judge's engine process."""

    def __init__(self, path: str, dtype: str, vllm: VLLMConfig, device_type: str, key: str,
                 timeout_s: float = 600.0) -> None:
        self.spec = JudgeSpec(path, dtype, vllm, device_type, os.getpid(), timeout_s)
        self.key = key
        self.process = self.requests = self.results = None

    def start(self) -> None:
        """Start the engine process; returns once vLLM has loaded the judge."""
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no vLLM state of the trainer's
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=serve_judge, args=(self.spec, self.requests, self.results),
                                       name="gspo-judge-engine")
        self.process.start()
        self.answer()  # "ready"

    def answer(self):
        return awaited(self.process, self.results, self.spec.timeout_s, f"{self.key} (backend=vllm): the judge's "
                       "engine process", f"{self.key}.engine_timeout_s")

    def ask(self, kind: str, payload):
        if self.process is None:
            self.start()
        self.requests.put((kind, payload))
        return self.answer()

    def verdict_logprobs(self, prompt_ids: list[list[int]], verdict_ids: list[int]) -> list[list[float]]:
        """[n][len(verdict_ids)]: log p(verdict's first token | grading prompt) of each prompt."""
        return self.ask("logprobs", (prompt_ids, verdict_ids))

    def answers(self, prompt_ids: list[list[int]], max_new_tokens: int, stop: list[int]) -> list[list[int]]:
        """The judge's greedy answer to each prompt, as token ids, cut at the `stop` ids."""
        return self.ask("answers", (prompt_ids, max_new_tokens, stop))

    def close(self) -> None:
        if self.process is not None:
            stopped(self.process, self.requests)
            self.process = None


def serve_judge(spec: JudgeSpec, requests, results) -> None:
    """The judge engine process's main: load the judge in vLLM, then answer requests until "stop" or until the
    training process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops this process after its checkpoint
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = judge_llm(spec)
        results.put(("ready", None))
        while True:
            try:
                kind, payload = requests.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != spec.parent:
                    return
                continue
            if kind == "stop":
                return
            results.put((kind, verdict_logprobs(llm, *payload) if kind == "logprobs" else answers(llm, *payload)))
    except BaseException:  # noqa: BLE001 - whatever stops the engine reaches the trainer as its traceback
        results.put(("error", traceback.format_exc()))


def judge_llm(spec: JudgeSpec):
    """vLLM's engine with the judge's weights, on the training process's cores on CPU."""
    import torch

    if spec.device_type == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        torch.set_num_threads(len(cores))
    from gspo_lab.rollout.vllm.calls import engine_arguments
    from gspo_lab.rollout.vllm.setup import environment

    environment()
    from vllm import LLM

    arguments = engine_arguments(spec.path, spec.dtype, spec.device_type, spec.vllm)
    return LLM(**dict(arguments, load_format="auto", logprobs_mode="raw_logprobs"))


def verdict_logprobs(llm, prompt_ids: list[list[int]], verdict_ids: list[int]) -> list[list[float]]:
    """log p(v | prompt) for each prompt and verdict token v: vLLM's prompt log-probs of prompt + [v] at v."""
    from vllm import SamplingParams

    params = SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    rows = [ids + [verdict] for ids in prompt_ids for verdict in verdict_ids]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in rows], params, use_tqdm=False)
    scores = [output.prompt_logprobs[-1][ids[-1]].logprob for output, ids in zip(outputs, rows)]
    width = len(verdict_ids)
    return [scores[i : i + width] for i in range(0, len(scores), width)]


def answers(llm, prompt_ids: list[list[int]], max_new_tokens: int, stop: list[int]) -> list[list[int]]:
    """Greedy answers as token ids, each ending before its first `stop` id."""
    from vllm import SamplingParams

    params = SamplingParams(n=1, temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [[t for t in output.outputs[0].token_ids if t not in stop] for output in outputs]
