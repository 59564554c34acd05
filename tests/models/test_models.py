"""Every model config builds a real transformers model that runs a forward and a generate; the char
tokenizer round-trips; model=hf loads a checkpoint this test saved; gradient checkpointing recomputes blocks."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch.distributed._composable import checkpoint
from omegaconf import OmegaConf
from transformers import AutoTokenizer, LogitsProcessorList, SuppressTokensLogitsProcessor

from gspo_lab import CONFIG_DIR
from gspo_lab.models import PretrainedModel, TinyModel, char_tokenizer
from gspo_lab.rollout import generate, token_logprobs
from gspo_lab.rollout.completions import stop_ids
from gspo_lab.rollout.generation import sampling_config
from gspo_lab.rollout.sampling import RowSampler
from gspo_lab.routing import is_moe
from gspo_lab.routing.adapters import find_routers

TINY_MODELS = sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("tiny_*.yaml"))
EXPECTED_CLASS = {
    "tiny_moe": "Qwen3MoeForCausalLM",
    "tiny_dense": "Qwen3ForCausalLM",
    "tiny_mixtral": "MixtralForCausalLM",
    "tiny_olmoe": "OlmoeForCausalLM",
    "tiny_qwen2_moe": "Qwen2MoeForCausalLM",
    # the routing-replay families (tests/routing): hidden size 64, a tenth of the size
    "tiny_deepseek_v3": "DeepseekV3ForCausalLM",
    "tiny_gpt_oss": "GptOssForCausalLM",
    "tiny_glm4_moe": "Glm4MoeForCausalLM",
    "tiny_qwen3_next": "Qwen3NextForCausalLM",
    "tiny_qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "tiny_llama4": "Llama4ForCausalLM",
    "tiny_minimax_m2": "MiniMaxM2ForCausalLM",
    "tiny_ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "tiny_dots1": "Dots1ForCausalLM",
    "tiny_solar_open": "SolarOpenForCausalLM",
    "tiny_exaone_moe": "ExaoneMoeForCausalLM",
}
ROUTING_FAMILIES = set(list(EXPECTED_CLASS)[5:])


def test_every_tiny_config_is_tested():
    assert TINY_MODELS == sorted(EXPECTED_CLASS)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_forward_and_generate(name):
    torch.manual_seed(0)
    model, tokenizer = instantiate(OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{name}.yaml")).load()
    assert type(model).__name__ == EXPECTED_CLASS[name]
    smallest = 1e5 if name in ROUTING_FAMILIES else 0.9e6
    assert smallest < sum(p.numel() for p in model.parameters()) < 2.2e6  # the tiny sizes: about 1-2M (0.2-0.4M)
    batch = tokenizer(["123+456=", "1+2="], return_tensors="pt", padding=True)
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    out = generate(model, tokenizer, ["123+456=", "1+2="], max_new_tokens=5)
    assert out.completion_ids.shape[0] == 2 and out.completion_ids.shape[1] <= 5
    assert out.completion_mask.sum() >= 2 and len(out.texts) == 2


def test_char_tokenizer_round_trip_and_reload(tmp_path):
    tok = char_tokenizer()
    text = "nums 18 20 5 target 2: (20-18)*5/5"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(text)["input_ids"] == ids and reloaded.padding_side == "left"
    assert reloaded.pad_token_id == tok.pad_token_id and reloaded.eos_token_id == tok.eos_token_id


def test_left_padding_leaves_the_last_logits_unchanged():
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config={"hidden_size": 32, "num_hidden_layers": 1,
                                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                                 "head_dim": 16, "intermediate_size": 64}).load()
    alone = generate(model, tok, ["1+2="], 4, greedy=True)
    padded = generate(model, tok, ["1+2=", "123456+789="], 4, greedy=True)
    assert alone.texts[0] == padded.texts[0]


def test_hf_loads_a_checkpoint_this_test_saved(tmp_path):
    torch.manual_seed(0)
    model, tok = instantiate(OmegaConf.load(Path(CONFIG_DIR) / "model" / "tiny_moe.yaml")).load()
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    cfg = OmegaConf.load(Path(CONFIG_DIR) / "model" / "hf.yaml")
    cfg.path = str(tmp_path / "ckpt")
    loaded, loaded_tok = instantiate(cfg).load()
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    batch = tok(["12+3="], return_tensors="pt")
    assert torch.equal(loaded(**batch).logits, model(**batch).logits)  # bitwise: same weights, ops and shapes
    assert loaded_tok("12+3=")["input_ids"] == tok("12+3=")["input_ids"]
    bf16, _ = PretrainedModel(path=str(tmp_path / "ckpt"), dtype="bfloat16", gradient_checkpointing=True).load()
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert all(checkpoint.state(block) is not None for block in bf16.model.layers)  # gradient checkpointing is on


def test_model_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.path=.*missing.*no config\.json"):
        PretrainedModel(path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="model.path is not set"):
        PretrainedModel()
    with pytest.raises(ValueError, match=r"model\.arch='nope'"):
        TinyModel(arch="nope")
    with pytest.raises(ValueError, match=r"model\.dtype='float8'"):
        TinyModel(arch="qwen3", dtype="float8")


DENSE = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 32}


def test_a_padded_vocabulary_has_rows_beyond_the_tokenizers_and_they_decode_to_nothing():
    """model.config.vocab_size pads the embedding and output rows past the tokenizer's (Qwen3: 151,669 tokens,
    151,936 rows); a sampled padding id decodes to no text; fewer rows than tokens are refused."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config={**DENSE, "vocab_size": 4 * len(char_tokenizer())}).load()
    assert model.get_output_embeddings().weight.shape[0] == 4 * len(tok)
    out = generate(model, tok, ["1+2="] * 8, max_new_tokens=6, suppress_eos=True)
    padding = out.completion_ids >= len(tok)  # a random model puts ~3/4 of its mass there
    assert padding.any()
    kept = [[i for i in row.tolist() if i < len(tok)] for row in out.completion_ids]
    assert out.texts == tok.batch_decode(kept, skip_special_tokens=True)
    with pytest.raises(ValueError, match=r"model\.config\.vocab_size=50 must be an integer >= the tokenizer's 99"):
        TinyModel(arch="qwen3", config={**DENSE, "vocab_size": 50}).load()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_gradient_checkpointing_recomputes_every_block_in_either_mode(mode):
    """RL updates run in eval mode, where transformers' own checkpointing does nothing; ours recomputes each
    block in the backward pass in eval mode (RL) and train mode (SFT, with dropout), with unchanged gradients."""
    config = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 16, "intermediate_size": 64, "attention_dropout": 0.5}
    block_calls, grads = {}, {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, tok = TinyModel(arch="qwen3", config=config, gradient_checkpointing=checkpointing).load()
        model.train(mode == "train")
        calls = []
        for block in model.model.layers:  # a submodule's hook sees every recomputation, whoever checkpoints
            block.self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
        batch = tok(["12+3=15", "1+2=3"], return_tensors="pt", padding=True)
        torch.manual_seed(1)  # the same dropout masks in both runs
        logp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 3)
        logp.sum().backward()
        block_calls[checkpointing] = len(calls)
        grads[checkpointing] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert block_calls == {False: 2, True: 4}  # two blocks, each run again in the backward pass
    assert torch.equal(grads[True], grads[False])  # bitwise: recomputation repeats the same ops on the same shapes


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("tiny_*.yaml")) + ["small_moe"])
def test_the_skeleton_a_plan_checks_has_the_loaded_models_routers(name):
    """The plan decides on the architecture built on the meta device; it must see what loading builds."""
    source = instantiate(OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{name}.yaml"))
    skeleton = source.skeleton()
    assert all(p.device.type == "meta" for p in skeleton.parameters())  # nothing allocated
    model, _ = source.load()
    assert is_moe(skeleton) == is_moe(model)
    if is_moe(model):
        assert [n for n, _, _ in find_routers(skeleton, "test")] == [n for n, _, _ in find_routers(model, "test")]


def test_suppress_eos_never_samples_a_stop_token_where_the_model_often_would():
    """A head of zeros gives every token the same probability: 64 rows x 20 steps then end at the EOS in some rows
    (each step 1 / len(tok), about 13 EOS draws expected); with suppress_eos no row ever samples it."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config=DENSE).load()
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    free = generate(model, tok, ["1+2="] * 64, max_new_tokens=20)
    assert (~free.truncated).sum() >= 3  # rows that stopped at the EOS
    fixed = generate(model, tok, ["1+2="] * 64, max_new_tokens=20, suppress_eos=True)
    assert fixed.completion_ids.shape[1] == 20 and fixed.truncated.all() and fixed.completion_mask.all()
    assert not (fixed.completion_ids == tok.eos_token_id).any()


def test_our_eos_suppression_draws_what_transformers_suppression_would():
    """SuppressTokens writes -inf into the stop tokens' columns in place; transformers' SuppressTokensLogitsProcessor
    builds a new tensor with them -inf: the same scores, so with temperature and top-p after it the same tokens."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config=DENSE).load()
    prompts, seeds, stop = ["1+2="] * 32, torch.arange(32) * 7919, stop_ids(tok, model)
    ours = generate(model, tok, prompts, 16, temperature=0.7, top_p=0.9, suppress_eos=True, row_seeds=seeds)
    encoded = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        theirs = model.generate(**encoded, generation_config=sampling_config(tok, 16, stop),
                                logits_processor=LogitsProcessorList([SuppressTokensLogitsProcessor(stop),
                                                                      RowSampler(seeds, 16, 0.7, 0.9)]))
    assert torch.equal(ours.completion_ids, theirs.sequences[:, encoded["input_ids"].shape[1]:])
    assert ours.truncated.all()
