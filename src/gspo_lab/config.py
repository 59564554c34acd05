"""Validated settings of one RL run: what `rollout:`, `train:` and `routing:` in the Hydra config build.

Each dataclass checks its values in `__post_init__` and names the key, the value and the rule, so a typo
fails before any model is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gspo_lab.engine_settings import (  # noqa: F401 - re-exported: conf/ names them as gspo_lab.config.*
    ASYNC_MODES,
    PRECISIONS,
    STALE_POLICIES,
    WEIGHT_BITS,
    LAG_SPREADS,
    EngineConfig,
    OverlapConfig,
    VLLMConfig,
    positive_int,
    require,
)

from gspo_lab.train_config import TrainConfig  # noqa: F401 - re-exported: conf/ names gspo_lab.config.TrainConfig

REPLAY_MODES = ("off", "r2", "r3")


@dataclass
class RolloutConfig:
    """How completions are sampled each RL step.

    Args:
        prompts_per_step: prompts per RL step (across all ranks).
        group_size: completions per prompt; advantages are relative within a group.
        max_new_tokens: generation budget; completions without EOS by then are truncated.
        temperature: sampling temperature, applied identically when log-probs are computed.
        top_p: nucleus sampling threshold (1 disables it).
        mask_truncated: leave truncated completions out of the loss.
        backend: what generates (gspo_lab.rollout.backend): "hf" (transformers' `generate` on the trainer's
            weights, through `engine`), "vllm" (vLLM in this process, the trainer's weights pushed after every
            update; `vllm`), "replay" (completions recorded in a file), or a backend of your own.
        logprobs_from_generation: take old log-probs from the engine's own instead of a no-grad trainer forward
            (r2 routing replay needs the forward); null: true where the engine is the trainer itself (hf with
            `engine` at its defaults: exact), false otherwise (a simulated engine of rollout.engine.*, and vllm:
            a forward of the trainer's own, as TRL and verl take them; true is verl's bypass mode).
        suppress_eos: never sample EOS, so every completion has exactly max_new_tokens (benchmarks).
        share_prompt_prefill: prefill each group's prompt once and continue its group_size completions from its
            keys and values (gspo_lab.rollout.generation.prefill_distinct_prompts): the same samples to float
            rounding; engine router noise is then drawn once per prompt, as an engine with prefix caching does.
        filter_zero_std_groups: DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage)
            are dropped and further rounds of prompts are sampled until the step has `prompts_per_step`
            groups with differing rewards (gspo_lab.rollout.dynamic_sampling).
        max_sampling_rounds: with filter_zero_std_groups, the most rounds of prompts_per_step prompts sampled
            in one step; a step still short after them keeps zero-std groups (counted in rollout/unfilled_groups).
        stop_token_ids: token ids that end a completion, besides the tokenizer's EOS and every EOS of the
            checkpoint's generation config (a chat model's end of turn).
        generation_batch_size: rows per `generate` call (None: all of a rank's rows at once). Every row samples
            from its own seeded stream, so the samples do not depend on it (to float rounding of the logits), except
            under engine.router_noise, whose noise is drawn for each call's rows together.
        engine: how the hf engine differs from the trainer (`EngineConfig`; the default: not at all).
        vllm: vLLM's settings (`VLLMConfig`), for backend=vllm.
        options: the settings of any other backend, which its class checks (`RolloutBackend.check`).
        max_tool_calls: for a task with tools or an environment (multi-turn, gspo_lab.rollout.multi_turn): the
            rounds of tool calls a trajectory may make (TRL's max_tool_calling_iterations; None: until its
            length budget, max_new_tokens, which covers the model's and the tools' tokens together).
        max_tool_response_tokens: a tool result is cut to this many tokens (None: whole).
        tool_workers: worker processes that run tools and environments (row r's in worker r mod tool_workers).
        tool_timeout_s: a tool call still running after this is a timeout: its worker is killed.
        max_staleness: k, the most weight versions a trained row may lag the policy (versions count weight syncs,
            one per RL step; gspo_lab.rollout.sources.lagged). 0: the synchronous step, every row from the current
            weights.
        async_mode: how rows come to be stale when max_staleness > 0: "lagged" (deterministic, for studies: at
            step t the engine holds version max(t - k, 0)), or "overlap" (a vLLM engine in a process of its own
            generates the next steps' rollouts while the trainer trains; `overlap`; backend=vllm, on CPU).
        stale_policy: under overlap, a rollout too old for its step: "wait" (the engine never starts one that would
            be: it waits for the trainer's weights) or "drop" (it is dropped and generated again from the current
            weights; off_policy/dropped).
        overlap: async_mode=overlap's settings (`OverlapConfig`).
        partial: partial rollouts: one sequence written by several weight versions. Under async_mode=overlap new
            weights interrupt the engine's unfinished rows, which continue under them (gspo_lab.rollout.vllm.
            partial); under lagged (the deterministic form, gspo_lab.rollout.sources.lagged) a row advances one
            version every `segment_tokens` tokens, capped at the current one.
        segment_tokens: under partial=true in lagged mode, the tokens a row generates with one version.
        lag_spread: under async_mode=lagged, the versions a step's groups start from: "fixed" (every row from
            max(t - k, 0)) or "uniform" (each group's drawn from max(t - k, 0)..t, seeded by the run's seed and
            the step).
        rescore: a diagnostic: score the sampled tokens again with a second engine, whose log-probs then stand for
            the generating engine's (π_old under logprobs_from_generation=true; mismatch/*): null (none), "hf" (a
            forward of the engine rollout.engine.* describes), "vllm" (vLLM's prompt log-probs, rollout.vllm.*;
            temperature 1 only); naming the backend itself scores its samples with the same engine in one forward
            (gspo_lab.rollout.rescore).
    """

    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    mask_truncated: bool = False
    backend: str = "hf"
    logprobs_from_generation: bool | None = None
    suppress_eos: bool = False
    share_prompt_prefill: bool = True
    filter_zero_std_groups: bool = False
    max_sampling_rounds: int = 4
    stop_token_ids: list[int] = field(default_factory=list)
    generation_batch_size: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    options: dict = field(default_factory=dict)
    max_tool_calls: int | None = None
    max_tool_response_tokens: int | None = None
    tool_workers: int = 2
    tool_timeout_s: float = 10.0
    max_staleness: int = 0
    async_mode: str = "lagged"
    stale_policy: str = "wait"
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    partial: bool = False
    segment_tokens: int | None = None
    lag_spread: str = "fixed"
    rescore: str | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.backend, str), "rollout.backend", self.backend,
                "must name a backend (gspo_lab.rollout.backend.BACKENDS)")
        for key in ("max_tool_calls", "max_tool_response_tokens"):
            value = getattr(self, key)
            require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                    f"rollout.{key}", value, "must be null or an integer >= 1")
        require(isinstance(self.tool_workers, int) and self.tool_workers >= 1, "rollout.tool_workers",
                self.tool_workers, "must be an integer >= 1")
        require(isinstance(self.tool_timeout_s, (int, float)) and self.tool_timeout_s > 0, "rollout.tool_timeout_s",
                self.tool_timeout_s, "must be a number > 0")
        require(isinstance(self.max_staleness, int) and not isinstance(self.max_staleness, bool)
                and self.max_staleness >= 0, "rollout.max_staleness", self.max_staleness, "must be an integer >= 0")
        require(self.async_mode in ASYNC_MODES, "rollout.async_mode", self.async_mode,
                f"must be one of {list(ASYNC_MODES)}")
        require(self.stale_policy in STALE_POLICIES, "rollout.stale_policy", self.stale_policy,
                f"must be one of {list(STALE_POLICIES)}")
        if self.async_mode == "overlap":
            self.check_overlap()
        else:
            self.refuse_overlap_settings()
        self.check_versions()
        require(self.rescore is None or isinstance(self.rescore, str), "rollout.rescore", self.rescore,
                "must be null or name a backend that scores (gspo_lab.rollout.backend.Scorer)")
        if self.logprobs_from_generation is None:  # what the backend can do (gspo_lab.rollout.backend), not its name
            from gspo_lab.rollout.backend import backend_class

            self.logprobs_from_generation = backend_class(self.backend).exact_logprobs(self)
        require(isinstance(self.logprobs_from_generation, bool), "rollout.logprobs_from_generation",
                self.logprobs_from_generation, "must be null, true or false")
        positive_int("rollout.prompts_per_step", self.prompts_per_step)
        positive_int("rollout.group_size", self.group_size, minimum=2)
        positive_int("rollout.max_new_tokens", self.max_new_tokens)
        positive_int("rollout.max_sampling_rounds", self.max_sampling_rounds)
        if self.generation_batch_size is not None:
            positive_int("rollout.generation_batch_size", self.generation_batch_size)
        require(isinstance(self.filter_zero_std_groups, bool), "rollout.filter_zero_std_groups",
                self.filter_zero_std_groups, "must be true or false")
        require(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0,
                "rollout.temperature", self.temperature, "must be a finite number > 0")
        require(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "rollout.top_p", self.top_p,
                "must satisfy 0 < top_p <= 1")
        require(not (self.suppress_eos and self.mask_truncated), "rollout.mask_truncated", self.mask_truncated,
                "rollout.suppress_eos=true truncates every completion, so masking truncated ones leaves nothing to "
                "train on (the loss is 0 every step); turn one of them off")
        ids = list(self.stop_token_ids or [])
        require(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids), "rollout.stop_token_ids",
                self.stop_token_ids, "must be a list of token ids (integers >= 0)")
        self.stop_token_ids = ids

    def refuse_overlap_settings(self) -> None:
        """Settings of async_mode=overlap alone, refused under lagged mode, where they would do nothing: its rollout
        is generated in the step from the version k steps back, so nothing is queued, waited for or dropped."""
        require(self.stale_policy == "wait", "rollout.stale_policy", self.stale_policy,
                "applies under rollout.async_mode=overlap only; async_mode=lagged generates each step's rollout "
                "from the weights k versions back and drops nothing (leave it at wait)")
        require(self.overlap.queue_size is None, "rollout.overlap.queue_size", self.overlap.queue_size,
                "applies under rollout.async_mode=overlap only; async_mode=lagged queues nothing (leave it null)")

    def check_versions(self) -> None:
        """rollout.partial, segment_tokens and lag_spread: which versions write a lagged step's tokens."""
        require(isinstance(self.partial, bool), "rollout.partial", self.partial, "must be true or false")
        require(not self.partial or self.max_staleness >= 1, "rollout.partial", self.partial,
                "a partial rollout's later tokens come from newer weights than its first: set rollout.max_staleness "
                ">= 1")
        segment = self.segment_tokens
        if self.partial and self.async_mode == "overlap":
            require(segment is None, "rollout.segment_tokens", segment, "applies in async_mode=lagged only: under "
                    "overlap new weights interrupt a rollout when they arrive (leave it null)")
        elif self.partial:
            require(isinstance(segment, int) and not isinstance(segment, bool) and segment >= 1,
                    "rollout.segment_tokens", segment, "must be an integer >= 1 under rollout.partial=true in lagged "
                    "mode: the tokens a row generates with one weight version")
        else:
            require(segment is None, "rollout.segment_tokens", segment, "applies under rollout.partial=true only "
                    "(leave it null)")
        require(self.lag_spread in LAG_SPREADS, "rollout.lag_spread", self.lag_spread,
                f"must be one of {list(LAG_SPREADS)}")
        require(self.lag_spread == "fixed" or (self.max_staleness >= 1 and self.async_mode == "lagged"),
                "rollout.lag_spread", self.lag_spread, "spreads the versions of async_mode=lagged: set "
                "rollout.max_staleness >= 1 with async_mode=lagged")

    def check_overlap(self) -> None:
        """What async_mode=overlap needs of the other rollout settings: a vLLM engine generating whole single-round
        rollouts ahead of the trainer, at most k versions old."""
        require(self.max_staleness >= 1, "rollout.async_mode", self.async_mode,
                "overlap generates ahead of the trainer, so its rows are stale: set rollout.max_staleness >= 1")
        queue = self.overlap.queue_size
        require(not (self.stale_policy == "wait" and queue is not None and queue > self.max_staleness),
                "rollout.overlap.queue_size", queue, f"under rollout.stale_policy=wait the engine generates at most "
                f"max_staleness={self.max_staleness} rollouts ahead; use a smaller queue or stale_policy=drop")
        for key, value, rule in (
                ("filter_zero_std_groups", self.filter_zero_std_groups, "its further rounds are sampled within the "
                 "step, from the current weights"),
                ("rescore", self.rescore, "a second engine would score in the trainer's process")):
            require(not value, f"rollout.{key}", value, f"not supported with rollout.async_mode=overlap: {rule}")

    @property
    def batch_size(self) -> int:
        """Completions per RL step."""
        return self.prompts_per_step * self.group_size


@dataclass
class RoutingConfig:
    """Routing replay for MoE models (GSPO paper section 5.3).

    Args:
        replay: "off"; "r2" records experts in the old-policy forward and replays them in training forwards
            (needs rollout.logprobs_from_generation=false); "r3" records them during generation and replays them
            in the old-policy forward, if any, and the training forwards. YAML's bare `off` (false) means "off".
        diagnostics_rows: rows of the rollout batch on which routing/changed_frac is measured: the trainer's
            experts before the updates (the first mini-batch's own forwards where they route freely and hold this
            many rows, else the batch's first rows, whole groups, in a no-grad forward) against one more no-grad
            forward after them; null measures all rows.
        diagnostics_every: run the forwards that exist only for the routing and mismatch diagnostics (the one
            after the updates; under replay, or when the first mini-batch is smaller than diagnostics_rows, the
            one before them too) every this many RL steps, from step 0. Their metrics mean the same on the steps
            they are logged; routing/override_frac and the mismatch measured on the first mini-batch's own
            forwards cost nothing and are logged every step.
    """

    replay: str = "off"
    diagnostics_rows: int | None = 32
    diagnostics_every: int = 1

    def __post_init__(self) -> None:
        if self.replay is False:
            self.replay = "off"
        require(self.replay in REPLAY_MODES, "routing.replay", self.replay, f"must be one of {list(REPLAY_MODES)}")
        if self.diagnostics_rows is not None:
            positive_int("routing.diagnostics_rows", self.diagnostics_rows)
        positive_int("routing.diagnostics_every", self.diagnostics_every)

    def check_against(self, rollout: RolloutConfig) -> None:
        require(not (self.replay == "r2" and rollout.logprobs_from_generation), "routing.replay", self.replay,
                "r2 records experts in the old-policy forward, which rollout.logprobs_from_generation=true skips; "
                "use r3 or turn logprobs_from_generation off")
