"""LoRA through PEFT (`model.lora.*`): train low-rank adapters instead of every weight of a large checkpoint.

    gspo-train model.lora.enabled=true model.lora.rank=16 model.lora.experts=false

PEFT's `get_peft_model` injects the adapters into the transformers model itself, so the policy the rest of the
framework sees is still that model (`LoraPolicy.model`): generation, the chunked log-probs, routing hooks (the
router classes stay in the module tree, under PEFT's wrappers) and checkpoints work unchanged. Attention and
MLP projections get ordinary LoRA layers (`target_modules`); the MoE experts' stacked weights ([E, out, in], [E, in, out] in GPT-OSS and Llama 4) and
the routers' gate weights, which are parameters rather than Linear modules in transformers 5, get PEFT's
parameter LoRA (`target_parameters`), so the gate weights train, also under routing replay. With
`objective.beta > 0` the KL reference is the same model with its adapters disabled (`LoraPolicy.disabled`): no
second copy of the weights. Checkpoints hold the adapters only (gspo_lab.module); `final/` holds the merged
model and `final/adapter/` the adapters (`LoraPolicy.save_final`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, OmegaConf

from gspo_lab.routing.adapters import ADAPTERS
from gspo_lab.seeding import LORA_INIT, stream_seed

if TYPE_CHECKING:
    from peft import PeftModel

LAYER_INDEX = re.compile(r"\.\d+\.")  # "model.layers.3.mlp.experts.down_proj" -> suffix "mlp.experts.down_proj"


@dataclass
class LoraSettings:
    """model.lora: whether and where LoRA adapters train.

    Args:
        enabled: train adapters instead of the full model.
        rank, alpha: LoRA's r and α (the update is α/r · B A).
        target_modules: Linear modules (by name suffix) that get adapters, e.g. the attention projections.
        experts: adapters on every MoE expert weight too (3-D stacked parameters). Off by default: PEFT's
            parameter LoRA rebuilds W + BA of the whole expert stack in every forward, every decode step included
            (generation 2.5x slower on bench_paper's shapes at hidden 256; docs/performance.md).
        routers: adapters on every router's gate weight (MoE models), so routing is trained.
    """

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    experts: bool = False
    routers: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"model.lora.rank={self.rank!r} must be a positive integer")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha={self.alpha!r} must be positive")
        if isinstance(self.target_modules, str) or not all(isinstance(m, str) for m in self.target_modules):
            raise ValueError(f"model.lora.target_modules={self.target_modules!r} must be a list of module names")
        self.target_modules = list(self.target_modules)

    @staticmethod
    def of(value) -> LoraSettings:
        """From the model config's `lora` entry (a DictConfig, a dict, None or settings already)."""
        if isinstance(value, LoraSettings):
            return value
        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
        try:
            return LoraSettings(**(value or {}))
        except TypeError as error:
            raise ValueError(f"model.lora: {error} (keys: enabled, rank, alpha, target_modules, experts, "
                             "routers)") from error


def _suffixes(names: list[str]) -> list[str]:
    """Parameter names as PEFT's target_parameters match them: the part after the layer index, once each."""
    return sorted({LAYER_INDEX.split(name, maxsplit=1)[-1] for name in names})


def target_parameters(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """The expert weights (3-D parameters) and router gate weights that get parameter LoRA."""
    names = []
    if settings.experts:
        names += [n for n, p in model.named_parameters() if p.ndim == 3]
    if settings.routers:
        names += [f"{n}.weight" for n, m in model.named_modules()
                  if type(m).__name__ in ADAPTERS and getattr(m, "weight", None) is not None and m.weight.ndim == 2]
    return _suffixes(names)


class LoraPolicy:
    """A policy whose adapters train; not a torch module, so holding it adds nothing to a state dict."""

    def __init__(self, peft_model: PeftModel) -> None:
        self.peft = peft_model

    @property
    def model(self) -> torch.nn.Module:
        """The transformers model with the adapters inside it: what the trainer uses."""
        return self.peft.get_base_model()

    def disabled(self):
        """A context in which the model computes as it did before any adapter trained (the KL reference)."""
        return self.peft.disable_adapter()

    def adapter_shapes(self, prefix: str = "") -> dict[str, tuple[int, ...]]:
        """State-dict names (each after `prefix`) and shapes of the adapters: the parameters that train."""
        return {prefix + name: tuple(p.shape) for name, p in self.model.named_parameters() if p.requires_grad}

    def base_fingerprint(self) -> float:
        """The float64 sum of every frozen weight: a checkpoint's adapters only fit the base they trained on."""
        return sum(p.detach().double().sum().item() for p in self.model.parameters() if not p.requires_grad)

    def save_checkpoint(self, checkpoint: dict, prefix: str) -> None:
        """Keep only the adapters in a Lightning checkpoint (the base weights come from the model source again
        on resume), with the base's fingerprint."""
        names = self.adapter_shapes(prefix)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in names}
        checkpoint["lora_base_fingerprint"] = self.base_fingerprint()

    def check_checkpoint(self, checkpoint: dict, prefix: str) -> None:
        """Refuse a checkpoint that does not hold exactly these adapters, for this base model."""
        shapes = self.adapter_shapes(prefix)
        saved = {name: tuple(value.shape) for name, value in checkpoint["state_dict"].items()}
        if saved != shapes:
            differ = sorted(n for n in shapes.keys() & saved.keys() if shapes[n] != saved[n])
            raise ValueError(f"model.lora: the checkpoint's weights are not this run's adapters (missing "
                             f"{sorted(shapes.keys() - saved.keys())[:3]}, unexpected "
                             f"{sorted(saved.keys() - shapes.keys())[:3]}, other shapes {differ[:3]}); resume with "
                             "the same model.lora settings")
        expected, found = checkpoint.get("lora_base_fingerprint"), self.base_fingerprint()
        if expected is None or abs(found - expected) > 1e-9 * max(1.0, abs(expected)):
            raise ValueError(f"model.lora: the checkpoint's adapters were trained on another base model (weight "
                             f"sum {expected} there, {found} here); resume with the same model and cold start")

    def save_final(self, path: Path) -> None:
        """`path/adapter`: the adapters (PeftModel.from_pretrained loads them); `path`: the merged model, which
        model=hf loads like any checkpoint. Merging replaces the adapters in the live model: call it last."""
        self.peft.save_pretrained(path / "adapter")
        self.peft.merge_and_unload().save_pretrained(path)


def apply_lora(model: torch.nn.Module, settings: LoraSettings, seed: int = 0) -> LoraPolicy:
    """Inject adapters into `model` (in place); only the adapters then require gradients. Their random
    initialisation (lora_A; lora_B starts at zero) comes from the run's seed alone, so a cold start trained or
    loaded from the cache, or any other use of the global generator before, gives the same adapters."""
    from peft import LoraConfig, get_peft_model  # imported on use: PEFT loads bitsandbytes, slow to import

    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0,
                        target_modules=settings.target_modules or None,
                        target_parameters=target_parameters(model, settings) or None)
    try:
        with torch.random.fork_rng(devices=[]):  # the global generator continues as if nothing had drawn
            torch.manual_seed(stream_seed(seed, LORA_INIT, 0))
            return LoraPolicy(get_peft_model(model, config))
    except ValueError as error:
        raise ValueError(f"model.lora.target_modules={settings.target_modules!r}: {error}") from error
