"""What vLLM's engine is asked and what it answers, for the colocated engine (gspo_lab.rollout.vllm.engine), the
engine process (gspo_lab.rollout.vllm.process) and the judge's engine: the config it builds from, its arguments,
each row's sampling parameters, and its outputs as `Completions`."""

from __future__ import annotations

import copy
import tempfile

import torch

from gspo_lab.rollout.backend import Sampling
from gspo_lab.routing.adapters import EXPERT_COUNT_KEYS


def expert_count(model: torch.nn.Module) -> int:
    """The experts per MoE layer, from the model's config."""
    config = model.config.get_text_config()
    return next(getattr(config, key) for key in EXPERT_COUNT_KEYS if getattr(config, key, None))


def saved_config(model: torch.nn.Module) -> tempfile.TemporaryDirectory:
    """A folder holding `model`'s config, which vLLM builds its model from (with dummy weights until a sync)."""
    folder = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
    config = copy.deepcopy(model.config)
    # a model built from config and never saved names no architecture, and vLLM would guess another runner
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder.name)
    return folder


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes


def engine_arguments(folder: str, dtype: str, device_type: str, config, lora_rank: int | None = None) -> dict:
    """vLLM's `LLM` arguments for an engine built from the config in `folder` (`saved_config`), with the rollout.vllm
    settings `config`, on `device_type` ("cpu" or "cuda"), in `dtype`; serving one LoRA adapter of up to
    `lora_rank` where given (rollout.vllm.lora_sync=adapter)."""
    on_cpu = device_type == "cpu"
    lora = {} if lora_rank is None else {
        "enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in LORA_RANKS if r >= lora_rank)}
    # on CPU the KV cache is this engine's rollout.vllm.cpu_kv_cache_gb (a VLLM_CPU_KVCACHE_SPACE of the user's
    # wins); on a GPU gpu_memory_utilization sizes it
    kv_cache = {"kv_cache_memory_bytes": config.cpu_kv_cache_gb * 2**30} if on_cpu else {}
    return dict(
        **kv_cache, **lora, model=folder, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, seed=0,
        runner="generate",
        # a partly prefilled row's sampled token is discarded by rewinding its seeded generator, which CPU
        # generators cannot do (RuntimeError: CPU Generator does not use offset): on CPU each prompt is prefilled
        # whole
        enable_chunked_prefill=not on_cpu,
        max_model_len=config.max_model_len, logprobs_mode="processed_logprobs", generation_config="vllm",
        enforce_eager=config.enforce_eager, gpu_memory_utilization=config.gpu_memory_utilization,
        enable_prefix_caching=config.enable_prefix_caching,
    )


def sampling_params(sampling: Sampling, seeds: list[int | None], stop: list[int]) -> list:
    """vLLM's `SamplingParams` of each row: `sampling`, row n's seed (None: greedy), cut at the `stop` ids after
    the fact (`gspo_lab.rollout.completions.from_token_lists`), so vLLM itself ignores EOS."""
    from vllm import SamplingParams

    return [SamplingParams(n=1, temperature=0.0 if sampling.greedy else sampling.temperature, top_p=sampling.top_p,
                           max_tokens=sampling.max_new_tokens, seed=seed, logprobs=0 if sampling.logprobs else None,
                           stop_token_ids=stop, ignore_eos=True, detokenize=False) for seed in seeds]


def sampled_lists(outputs: list, logprobs: bool) -> tuple[list[list[int]], list[list[float]] | None]:
    """vLLM's request outputs as plain lists: each row's sampled token ids, and the log-prob of each (where
    `logprobs`)."""
    samples = [output.outputs[0] for output in outputs]
    tokens = [list(sample.token_ids) for sample in samples]
    if not logprobs:
        return tokens, None
    return tokens, [[step[token].logprob for step, token in zip(sample.logprobs, ids)]
                    for sample, ids in zip(samples, tokens)]


def generate_lists(llm, encoded: list[list[int]], sampling: Sampling, seeds: list[int | None], stop: list[int],
                   lora_request=None) -> tuple[list, list[list[int]], list[list[float]] | None]:
    """One `generate` call of vLLM's `llm` on prompts given as token ids: its request outputs, and each row's
    sampled token ids and their log-probs (where `sampling.logprobs`)."""
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded], sampling_params(sampling, seeds, stop),
                           use_tqdm=False, lora_request=lora_request)
    return (outputs, *sampled_lists(outputs, sampling.logprobs))
