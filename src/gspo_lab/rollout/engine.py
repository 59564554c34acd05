"""rollout.backend=hf, the default rollout backend (gspo_lab.rollout.backend): transformers' `generate`, on the
trainer's model or on an engine made to differ from the trainer the way an inference engine does (issue 13; GSPO
paper section 5.4, R3 arXiv 2510.11370).

    rollout.engine.precision     fp32 | fp16 | bf16   generation with a float16 or bfloat16 copy of the weights,
                                                      computing in that dtype whatever trainer.precision is
    rollout.engine.router_noise  σ >= 0               Gaussian noise on router logits in generation, σ × their std
    rollout.engine.weight_bits   null | 8             generation with weights fake-quantised per output channel

The defaults make the engine the trainer itself (no copy, no hook: exact, as before). Otherwise, and whenever
rollout.max_staleness > 0 (the engine then holds older weights than the trainer), the engine holds its own copy
of the policy, refreshed from the trainer's weights before every rollout (so after every RL step's updates;
`time/engine_sync_s`), and router noise is a hook on the generating model's routers that recomputes the top-k and
its gate weights from the noisy logits, the way the router itself would.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager, nullcontext
from typing import ClassVar, Iterator

import torch
from torch import Tensor

from gspo_lab.config import PRECISIONS, RolloutConfig
from gspo_lab.rollout.backend import RunSettings, Sampling
from gspo_lab.rollout.completions import Completions, Generated
from gspo_lab.rollout.generation import generate
from gspo_lab.rollout.logprobs import token_logprobs
from gspo_lab.rollout.packing import MIN_SAVING, packs_exactly
from gspo_lab.routing.adapters import ADAPTERS, expert_input_dim
from gspo_lab.routing.hooks import router_hooks


def fake_quantise(weight: Tensor, bits: int, input_dim: int = -1) -> Tensor:
    """Symmetric per-output-channel quantisation, returned dequantised: w_q = round(w / s) s with
    s = max |w| over the channel / (2^(bits-1) - 1). A channel is everything but `input_dim`: a row of a
    Linear weight [out, in] (input_dim -1), an (expert, output) pair of an expert bank [experts, out, in]
    (-1) or [experts, in, out] (-2).

    >>> fake_quantise(torch.tensor([[1.0, -0.5, 0.26]]), 8).tolist()  # s = 1/127: 0.26 -> 33/127
    [[1.0, -0.5039370059967041, 0.25984251499176025]]
    """
    levels = 2 ** (bits - 1) - 1
    scale = weight.abs().amax(dim=input_dim, keepdim=True).clamp(min=torch.finfo(weight.dtype).tiny) / levels
    return torch.round(weight / scale) * scale


def quantised_weights(model: torch.nn.Module) -> dict[str, int]:
    """The weights an int8/fp8 inference engine stores quantised, by parameter name, each with its input
    dimension for `fake_quantise`: the weight [out, in] of every Linear layer and every 3-D weight of an expert
    bank, [experts, out, in] or [experts, in, out] by family (routing.adapters.expert_input_dim). Kept in full
    precision, as vLLM and SGLang keep them: biases (GPT-OSS's expert biases too), norms, embeddings and the
    output head, router gates (every router, and a Linear with a single output: the shared-expert gate of
    Qwen2-MoE and Qwen3-Next), convolutions and LoRA adapters."""
    head = model.get_output_embeddings()
    weights = {}
    for prefix, module in model.named_modules():
        if ".lora_" in prefix or module is head or type(module).__name__ in ADAPTERS:
            continue
        if isinstance(module, torch.nn.Linear):
            if module.out_features > 1:
                weights[f"{prefix}.weight"] = -1
        elif not type(module).__module__.startswith("torch."):  # a model's own module: 3-D weights are experts'
            for name, weight in module.named_parameters(recurse=False):
                if weight.ndim == 3:
                    weights[f"{prefix}.{name}"] = expert_input_dim(module, "rollout.engine.weight_bits")
    return weights


SCORE_ROWS = 32  # rows per forward of `RolloutEngine.score`
SCORE_CHUNK_TOKENS = 8192  # (row, token) positions whose logits one chunk of it holds


class RolloutEngine:
    """rollout.backend=hf (a `RolloutBackend`): the model that generates, with transformers' `generate`, and the
    differences it has from the trainer's `model` (rollout.engine)."""

    name: ClassVar[str] = "hf"
    continues_from_token_ids: ClassVar[bool] = True
    samples_synced_weights: ClassVar[bool] = True  # a copy of its own under rollout.max_staleness > 0
    returns_logprobs: ClassVar[bool] = True
    returns_experts: ClassVar[bool] = True  # the routing trace of its generation (and of its copy's router noise)
    serves_evaluation: ClassVar[bool] = False  # evaluation runs on the trainer's model, never on an engine copy
    runs_apart: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module, rollout: RolloutConfig) -> None:
        self.trainer_model, self.config = model, rollout.engine
        self.copy, self.quantised = None, {}  # quantised: parameter name -> input dimension (quantised_weights)
        self.padding_free = True  # scoring packed where the model packs exactly (train.padding_free)
        if self.config.copies_weights or rollout.max_staleness > 0:
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()
            for parameter in self.copy.parameters():  # weights only: buffers (rotary frequencies) stay as they are
                parameter.data = parameter.data.to(PRECISIONS[self.config.precision])
            if self.config.weight_bits is not None:
                self.quantised = quantised_weights(self.copy)
            self.sync()

    @classmethod
    def check(cls, run: RunSettings) -> None:
        """An engine copy of the weights cannot be made from FSDP's shards."""
        if run.sharded and run.rollout.engine.copies_weights:
            raise ValueError("rollout.engine.precision / weight_bits: an engine copy of the weights is not supported "
                             "with trainer=fsdp (sharded weights); use trainer=ddp or the default engine")

    @classmethod
    def exact_logprobs(cls, rollout: RolloutConfig) -> bool:
        """Exact where the engine is the trainer's model itself (rollout.engine at its defaults)."""
        return rollout.engine.is_trainer

    @classmethod
    def check_scoring(cls, rollout: RolloutConfig) -> None:
        """It scores at any temperature."""

    @property
    def model(self) -> torch.nn.Module:
        """The model generation runs on: the engine's copy, or the trainer's model itself."""
        return self.trainer_model if self.copy is None else self.copy

    @property
    def dtype(self) -> str:
        """The dtype of the generating model's weights."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the trainer's current weights into the engine's (cast, then those of `quantised_weights`
        quantised): after every update. LoRA adapters (model.lora) are copied and cast but never quantised: an
        engine serving adapters on a quantised base keeps them in its activation dtype."""
        if self.copy is None:
            return
        device = next(self.trainer_model.parameters()).device
        if next(self.copy.parameters()).device != device:  # Lightning moved the trainer's model, not this copy
            self.copy.to(device)
        for (name, source), target in zip(self.trainer_model.named_parameters(), self.copy.parameters()):
            value = source.detach().to(target.dtype)
            if name in self.quantised:
                value = fake_quantise(value.float(), self.config.weight_bits, self.quantised[name]).to(target.dtype)
            target.copy_(value)

    def close(self) -> None:
        """Nothing to stop: the copy, if any, is an ordinary module."""

    def generate(self, tokenizer, prompts: list[str] | list[list[int]], sampling: Sampling,
                 row_seeds: Tensor | None = None,
                 routing=None) -> Generated:
        """One completion per prompt with transformers' `generate` (gspo_lab.rollout.generation), row n from the
        stream `row_seeds[n]`, with its log-probs, and the experts `routing` records in generation."""
        with self.generating(), routing.generation(self.model) if routing is not None else nullcontext():
            completions = generate(
                self.model, tokenizer, prompts, sampling.max_new_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, greedy=sampling.greedy, suppress_eos=sampling.suppress_eos,
                return_logprobs=sampling.logprobs, share_prompts=sampling.share_prompts,
                stop_token_ids=sampling.stop_token_ids, add_special_tokens=sampling.add_special_tokens,
                row_seeds=row_seeds,
            )
        if routing is None:
            return Generated(completions)
        prompt_len = completions.prompt_ids.shape[1]
        return Generated(completions, routing.generation_trace(prompt_len,
                                                               prompt_len + completions.completion_ids.shape[1]))

    @torch.no_grad()
    def score(self, tokenizer, completions: Completions, temperature: float) -> Tensor:
        """log softmax(logits / temperature) [N, C] of the completion tokens under the generating model (the
        engine's copy, in its precision), in one forward over prompt and completion (rollout.rescore), SCORE_ROWS
        rows at a time, the logits of at most SCORE_CHUNK_TOKENS positions alive at once (gspo_lab.rollout.logprobs;
        a 152k vocabulary in float32: 5 GB), padding-free where the architecture keeps packed rows apart
        (gspo_lab.rollout.packing)."""
        input_ids = torch.cat([completions.prompt_ids, completions.completion_ids], 1)  # [N, P + C]
        attention_mask = torch.cat([completions.prompt_mask, completions.completion_mask], 1)
        device = next(self.model.parameters()).device
        packed = self.padding_free and packs_exactly(self.model)  # probed outside router noise (`generating`)
        parts = []
        with self.generating():
            for rows in range(0, len(input_ids), SCORE_ROWS):
                logp, _ = token_logprobs(self.model, input_ids[rows:rows + SCORE_ROWS].to(device),
                                         attention_mask[rows:rows + SCORE_ROWS].to(device),
                                         completions.completion_ids.shape[1], temperature,
                                         chunk_tokens=SCORE_CHUNK_TOKENS, packed=packed, pack_min_saving=MIN_SAVING)
                parts.append(logp.float())
        return torch.cat(parts) * completions.completion_mask.to(device)

    def generating(self) -> ExitStack:
        """Around generate: an engine copy computes in its own precision, with the autocast that
        trainer.precision wraps the RL step in turned off (under bf16-mixed a float16 copy would multiply in
        bfloat16 and cache float32 keys); router noise on the engine model's routers (none by default). The
        default engine is the trainer's model itself and computes as the trainer does."""
        context = ExitStack()
        if self.copy is not None:
            device_type = next(self.copy.parameters()).device.type
            context.enter_context(torch.autocast(device_type, enabled=False))
        if self.config.router_noise != 0:
            context.enter_context(noisy_routers(self.model, self.config.router_noise))
        return context


@contextmanager
def noisy_routers(model: torch.nn.Module, sigma: float) -> Iterator[None]:
    """Every router's logits get ε ~ N(0, (σ · std(logits of that token))²); the top-k is taken from the noisy
    logits and the gate weights computed from them as that router computes them for its choice
    (RouterAdapter.replayed). For sigmoid routers with a selection bias (DeepSeek-V3, GLM-4.5, MiniMax-M2) the
    noisy choice is the top-k of the noisy logits without the bias or group limit: noise, not their rule."""

    def perturb(layer, router, adapter, hidden, output, call):
        logits, indices = adapter.choice(router, output)
        noisy = logits + sigma * logits.std(dim=-1, keepdim=True) * torch.randn_like(logits)  # [N, E]
        chosen = noisy.topk(indices.shape[-1], dim=-1).indices.to(indices.dtype)  # [N, k]
        return adapter.replayed(router, hidden, adapter.with_logits(output, noisy), chosen)

    with router_hooks(model, perturb, "rollout.engine.router_noise"):
        yield
