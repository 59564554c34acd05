"""The settings of the engines behind `rollout:` (gspo_lab.config.RolloutConfig holds them): the hf engine's
difference from the trainer (`EngineConfig`), vLLM's (`VLLMConfig`) and overlap mode's (`OverlapConfig`), and the
validation helpers every settings dataclass uses: a bad value names the key, the value and the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # rollout.engine.precision
WEIGHT_BITS = (None, 8)  # rollout.engine.weight_bits


def require(ok: bool, key: str, value, rule: str) -> None:
    """ValueError naming the setting `key`, its `value` and the `rule` it breaks, unless `ok`."""
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: {rule}")


def positive_int(key: str, value, minimum: int = 1) -> None:
    """`require` that the setting `key` is an integer >= `minimum`."""
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key, value,
            f"must be an integer >= {minimum}")


@dataclass
class EngineConfig:
    """How the rollout engine differs from the trainer; every default keeps it identical.

    Args:
        precision: "fp32" (the trainer's float32 weights), "fp16" (a float16 copy: 3 more mantissa bits than
            bfloat16, the FP16 paper's fix for the mismatch, arXiv 2510.26788) or "bf16" (a bfloat16 copy).
        router_noise: σ of Gaussian noise added to MoE router logits during generation only, relative to the
            standard deviation of each token's logits; 0 adds none.
        weight_bits: None, or 8 for weights fake-quantised to 8 bits per output channel (symmetric, round to
            nearest) in the engine's copy.
    """

    precision: str = "fp32"
    router_noise: float = 0.0
    weight_bits: int | None = None

    def __post_init__(self) -> None:
        require(self.precision in PRECISIONS, "rollout.engine.precision", self.precision,
                f"must be one of {list(PRECISIONS)}")
        noise = self.router_noise
        require(isinstance(noise, (int, float)) and not isinstance(noise, bool) and math.isfinite(noise) and noise >= 0,
                "rollout.engine.router_noise", noise, "must be a finite number >= 0 (0: no noise)")
        require(self.weight_bits in WEIGHT_BITS, "rollout.engine.weight_bits", self.weight_bits,
                f"must be one of {list(WEIGHT_BITS)}")

    @property
    def copies_weights(self) -> bool:
        """Whether the engine needs weights of its own (another precision or quantised)."""
        return self.precision != "fp32" or self.weight_bits is not None

    @property
    def is_trainer(self) -> bool:
        """Whether generation runs on the trainer's own weights as they are (no copy, no router noise): the
        defaults, where the engine's log-probs are the trainer's."""
        return not (self.copies_weights or self.router_noise)


# rollout.vllm.lora_sync values: what a weight sync sends to vLLM under model.lora
LORA_SYNCS = ("merged", "adapter")


@dataclass
class VLLMConfig:
    """vLLM's settings for rollout.backend=vllm (gspo_lab.rollout.vllm.engine); the rest is vLLM's defaults.

    Args:
        dtype: the engine's weights and compute ("float32", "bfloat16", "float16"); null: the trainer model's.
        max_model_len: the longest prompt + completion it serves; null: the model's max_position_embeddings.
        gpu_memory_utilization: the share of the GPU vLLM may take (weights, activations, KV cache), beside the
            trainer colocated on it (TRL's colocate default is 0.3); not used on CPU.
        cpu_kv_cache_gb: GiB of KV cache on CPU, each engine its own (a VLLM_CPU_KVCACHE_SPACE of the user's wins).
        enforce_eager: no CUDA graphs (they take seconds to capture and memory to hold; a GPU run gains speed
            from false).
        enable_prefix_caching: a group's prompt is prefilled once and its keys and values reused.
        lora_sync: with model.lora, what a sync sends: "merged" (each wrapped weight as W + scale·BA, through the
            in-place reload) or "adapter" (the base weights once, then the adapters alone, which vLLM serves as a
            LoRA adapter: TRL's adapter sync; attention and MLP projections only).
    """

    dtype: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.3
    cpu_kv_cache_gb: int = 1
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    lora_sync: str = "merged"

    def __post_init__(self) -> None:
        require(self.lora_sync in LORA_SYNCS, "rollout.vllm.lora_sync", self.lora_sync,
                f"must be one of {list(LORA_SYNCS)}")
        require(self.dtype in (None, "float32", "bfloat16", "float16"), "rollout.vllm.dtype", self.dtype,
                "must be null, float32, bfloat16 or float16")
        if self.max_model_len is not None:
            positive_int("rollout.vllm.max_model_len", self.max_model_len)
        utilisation = self.gpu_memory_utilization
        require(isinstance(utilisation, (int, float)) and 0 < utilisation <= 1, "rollout.vllm.gpu_memory_utilization",
                utilisation, "must satisfy 0 < gpu_memory_utilization <= 1")
        positive_int("rollout.vllm.cpu_kv_cache_gb", self.cpu_kv_cache_gb)
        for key in ("enforce_eager", "enable_prefix_caching"):
            require(isinstance(getattr(self, key), bool), f"rollout.vllm.{key}", getattr(self, key),
                    "must be true or false")


# rollout.async_mode values: lagged (deterministic; gspo_lab.rollout.sources.lagged), overlap (generation beside
# training in an engine process of its own; gspo_lab.rollout.sources.overlap)
ASYNC_MODES = ("lagged", "overlap")
# rollout.lag_spread values, under async_mode=lagged: every group from the version k back, or each from one drawn
# uniformly from the last k + 1
LAG_SPREADS = ("fixed", "uniform")
# rollout.stale_policy values, under async_mode=overlap: what happens to a rollout more than k versions old
STALE_POLICIES = ("wait", "drop")


@dataclass
class OverlapConfig:
    """rollout.async_mode=overlap's settings (gspo_lab.rollout.sources.overlap): a vLLM engine in a process of its own
    generates the next steps' rollouts while the trainer trains.

    Args:
        queue_size: the rollouts the engine may generate ahead of the one being trained on; null: max_staleness.
            Under stale_policy=wait it is at most max_staleness (the engine could not start one further ahead); under
            drop it may be larger, and a rollout more than max_staleness versions old when its step comes is
            dropped and generated again.
        engine_cores: the CPU cores the engine process runs on; the trainer process keeps the others. null: the last
            core of those this process may use.
        timeout_s: how long the trainer waits for the engine (its start, a rollout) before it stops the run.
    """

    queue_size: int | None = None
    engine_cores: list[int] | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.queue_size is not None:
            positive_int("rollout.overlap.queue_size", self.queue_size)
        cores = self.engine_cores
        require(cores is None or (len(cores) > 0 and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                          for c in cores)),
                "rollout.overlap.engine_cores", cores,
                "must be null or a non-empty list of core numbers (integers >= 0)")
        if cores is not None:
            self.engine_cores = list(cores)
        require(isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0, "rollout.overlap.timeout_s",
                self.timeout_s, "must be a number > 0")
