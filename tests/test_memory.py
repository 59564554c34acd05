"""gspo_lab.memory: the estimate of a run's GPU memory adds up as its formula says, by hand."""

import pytest

from gspo_lab.memory import GB, ModelShape, estimate_memory

# DeepSeek-R1-Distill-Qwen-1.5B's shape (tests/test_recipes.py cites where each number comes from)
DISTILL = ModelShape(params=1.78e9, layers=28, kv_heads=2, head_dim=128, hidden=1536, vocab=151936)


def test_one_gpu_with_a_16_bit_engine_copy(compose):
    cfg = compose(["rollout.prompts_per_step=64", "rollout.group_size=8", "rollout.max_new_tokens=4096",
                   "rollout.generation_batch_size=128", "rollout.engine.precision=fp16", "train.micro_batch_size=8",
                   "train.logprob_chunk_rows=4"])
    estimate = estimate_memory(cfg, DISTILL, gpus=1, prompt_tokens=512)
    # 1.78e9 x (4 + 4 + 8) bytes of weights, gradients and AdamW, + 1.78e9 x 2 of the fp16 copy = 32.04 GB
    assert estimate.static == pytest.approx(32.04 * GB)
    # 28 layers x 2 (K, V) x 2 heads x 128 x 4 bytes = 57,344 bytes a token; x 128 rows x (512 + 4,096) tokens
    assert estimate.generation == 57_344 * 128 * 4_608 == 33_822_867_456
    # checkpointed inputs 28 x 8 rows x 4,608 x 1,536 x 4 = 6,341,787,648; logits of min(8,192, 4 rows x 4,096)
    # positions x 151,936 x 4 bytes x 3 = 14,935,916,544
    assert estimate.training == 6_341_787_648 + 14_935_916_544
    assert estimate.peak == estimate.static + estimate.generation  # the KV cache is the larger
    assert str(estimate) == "66 GB: 32.0 static + max(33.8 KV cache, 21.3 training activations)"


def test_fsdp_shards_the_state_and_holds_two_gathered_blocks(compose):
    cfg = compose(["trainer=fsdp", "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=8",
                   "train.minibatches=4", "train.logprob_chunk_rows=32"])
    estimate = estimate_memory(cfg, DISTILL, gpus=16, prompt_tokens=8)
    # 1.78e9 x 16 bytes / 16 GPUs = 1.78 GB, + 2 blocks of 1.78e9 / 28 params x 4 bytes each
    assert estimate.static == pytest.approx(1.78 * GB + 2 * 1.78e9 / 28 * 4)
    # 128 rows over 16 ranks: 8 rows a rank, generated in one call: 57,344 bytes x 8 rows x 16 tokens
    assert estimate.generation == 57_344 * 8 * 16
    # 8 rows / 4 mini-batches = 2 rows a forward: 28 x 2 x 16 x 1,536 x 4; logits of 2 rows x 8 positions
    assert estimate.training == 28 * 2 * 16 * 1_536 * 4 + 2 * 8 * 151_936 * 4 * 3
