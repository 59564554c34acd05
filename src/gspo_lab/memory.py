"""GPU memory of one RL run, estimated from its composed config and its model's shape: the figure each recipe's
header states (conf/experiment/recipe_*.yaml, checked in tests/test_recipes.py).

Per GPU, in bytes, with float32 weights and AdamW (the recipes' model.dtype=float32 under bf16-mixed):

    static      = params x (4 weights + 4 gradients + 8 AdamW moments) / shards  (+ 2 x params for a 16-bit engine copy)
                  (+ under FSDP, two gathered blocks: the one computing and the one prefetched, 2 x params / layers x 4)
    generation  = KV cache: layers x 2 x kv_heads x head_dim x 4 bytes x rows per generate call x (prompt + new tokens)
    training    = checkpointed layer inputs: layers x rows per forward x (prompt + new tokens) x hidden x 4 bytes
                  + one chunk of completion logits: positions x vocab x 4 bytes x 3 (logits, log-softmax, its gradient)
    peak        = static + max(generation, training)    (the KV cache is freed before the update starts)

The KV cache is counted in float32, an upper bound (a 16-bit cache holds half). Not counted: one layer's transient
activations, the CUDA context and the allocator's fragmentation, which the rest of the GPU has to hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

GB = 1e9
FLOAT32 = 4
SHARDED = "lightning.pytorch.strategies.ModelParallelStrategy"  # trainer=fsdp


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model's config.json that the estimate needs."""

    params: float  # every parameter, embeddings included
    layers: int  # num_hidden_layers
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim, or hidden_size / num_attention_heads
    hidden: int  # hidden_size
    vocab: int  # vocab_size


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by what holds them; `peak` is what the GPU must hold at once."""

    static: float
    generation: float
    training: float

    @property
    def peak(self) -> float:
        return self.static + max(self.generation, self.training)

    def __str__(self) -> str:
        return (f"{self.peak / GB:.0f} GB: {self.static / GB:.1f} static + max({self.generation / GB:.1f} KV cache, "
                f"{self.training / GB:.1f} training activations)")


def estimate_memory(cfg: DictConfig, shape: ModelShape, gpus: int, prompt_tokens: int) -> MemoryEstimate:
    """The estimate for the run `cfg` on `gpus` GPUs (one rank each) whose prompts have at most `prompt_tokens`
    tokens as formatted; every other number comes from the config."""
    rollout, train = cfg.rollout, cfg.train
    tokens = prompt_tokens + rollout.max_new_tokens  # the padded width of a batch
    rank_rows = rollout.prompts_per_step * rollout.group_size // gpus
    sharded = cfg.trainer.get("strategy", {}).get("_target_") == SHARDED
    static = shape.params * (4 + 4 + 8) / (gpus if sharded else 1)
    if sharded:
        static += 2 * shape.params / shape.layers * FLOAT32
    if rollout.engine.precision in ("fp16", "bf16"):
        static += 2 * shape.params
    generate_rows = min(rollout.generation_batch_size or rank_rows, rank_rows)
    kv_cache = shape.layers * 2 * shape.kv_heads * shape.head_dim * FLOAT32 * generate_rows * tokens
    forward_rows = train.micro_batch_size or rank_rows // train.minibatches
    if train.get("micro_batch_tokens"):  # a budget of real tokens: at most this many padded-width rows' worth
        forward_rows = max(1, min(forward_rows, train.micro_batch_tokens // tokens))
    checkpoints = shape.layers * forward_rows * tokens * shape.hidden * FLOAT32
    positions = min(train.logprob_chunk_tokens, min(train.logprob_chunk_rows, forward_rows) * rollout.max_new_tokens)
    logits = positions * shape.vocab * FLOAT32 * 3
    return MemoryEstimate(static, kv_cache, checkpoints + logits)
