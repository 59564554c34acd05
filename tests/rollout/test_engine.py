"""The rollout engine: exact by default, measurably different under each dose, kept in sync with the trainer,
and its mismatch to the trainer measured every RL step."""

import math
import re
from types import SimpleNamespace
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from gspo_lab import CONFIG_DIR
from gspo_lab.config import EngineConfig, RolloutConfig, VLLMConfig
from gspo_lab.models import TinyModel
from gspo_lab.rollout import generate, token_logprobs
from gspo_lab.rollout.vllm import setup as vllm_setup
from gspo_lab.rollout.engine import RolloutEngine
from gspo_lab.routing import is_moe, record_routing, replay_routing
from gspo_lab.step.probe import engine_mismatch
from gspo_lab.train import ConfigError, build, plan
from tests.numerics import RATIO_ROUNDING, rounding_tolerance

TINY_MOE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


@pytest.mark.parametrize("key, value, rule", [("precision", "fp8", "must be one of ['fp32', 'fp16', 'bf16']"),
                                              ("router_noise", -0.1, "must be a finite number >= 0"),
                                              ("weight_bits", 4, "must be one of [None, 8]")])
def test_bad_engine_settings_name_the_key_the_value_and_the_rule(key, value, rule):
    with pytest.raises(ValueError, match=rf"rollout\.engine\.{key}={value!r} is invalid: {rule}".replace("[", r"\[")):
        EngineConfig(**{key: value})


FAMILIES = sorted(path.stem for path in (Path(CONFIG_DIR) / "model").glob("tiny_*.yaml"))
# expert banks stored [experts, in, out], applied as x @ w[e]: GptOssExperts.forward (`current_state @
# self.gate_up_proj[expert_idx]`) and Llama4TextExperts.forward (`torch.bmm(hidden_states, self.gate_up_proj)`);
# every other family applies F.linear(x, w[e]) to [experts, out, in]
EXPERTS_IN_OUT = {"tiny_gpt_oss", "tiny_llama4"}
# what vLLM's and SGLang's int8/fp8 paths keep in full precision: biases (GPT-OSS's expert biases, DeepSeek's
# and ERNIE's selection biases too), norms, embeddings and the output head, router gates (`mlp.gate`, `router`,
# Qwen2-MoE's and Qwen3-Next's `shared_expert_gate`), GPT-OSS's attention sinks, the linear attention's conv1d
KEPT = re.compile(r"(bias|norm\.weight|embed_tokens\.weight|lm_head\.weight|\.(gate|router|shared_expert_gate)\.weight"
                  r"|sinks|A_log|conv1d\.weight)$")


@pytest.mark.numerics
@pytest.mark.parametrize("family", FAMILIES)
def test_weight_bits_quantises_each_output_channel_of_projections_and_experts_only(family, tiny_family):
    model, _ = tiny_family(family)
    engine = RolloutEngine(model, RolloutConfig(engine=EngineConfig(weight_bits=8)))  # fp32 weights: the grid is not rounded again
    expert_banks = 0
    for (name, weight), served in zip(model.named_parameters(), engine.model.parameters()):
        weight = weight.detach()
        if KEPT.search(name):
            assert torch.equal(served, weight), name
            continue
        expert_banks += weight.ndim == 3
        input_dim = -2 if weight.ndim == 3 and family in EXPERTS_IN_OUT else -1
        step = weight.abs().amax(input_dim, keepdim=True) / 127  # one step per output channel (of each expert)
        levels = served / step  # integers: (w / s rounded) s / s, two roundings of at most 127
        assert (levels - levels.round()).abs().max() <= rounding_tolerance(127, units=2), name
        assert levels.abs().amax(input_dim).round().eq(127).all(), name  # each channel's largest weight: ±127 steps
        assert ((served - weight).abs() - step / 2).max() <= rounding_tolerance(weight.abs().max(), units=2), name
        assert step.unique().numel() > step.numel() // 2, name  # the channels' scales are their own
    assert expert_banks == (2 * 2 if is_moe(model) else 0)  # gate_up_proj and down_proj in both layers


PROMPTS = ["123+456=", "1+2=", "77+8=", "500+500="]


@pytest.mark.numerics
@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp16_engine_is_the_trainer_cast_and_mismatches_it_less_than_bf16(family, tiny_family):
    """Both engines on the trainer's experts (replayed, so no top-k flips in between): the log-probs then differ
    by the weights' and activations' rounding, whose unit is 2^-11 in float16 and 2^-8 in bfloat16, 8 times
    more. Measured 5.9-9.3 times over the tiny families; asserted 4."""
    model, tokenizer = tiny_family(family)
    torch.manual_seed(1)
    out = generate(model, tokenizer, PROMPTS, 12)
    ids, mask = torch.cat([out.prompt_ids, out.completion_ids], 1), torch.cat([out.prompt_mask, out.completion_mask], 1)
    C, tokens = out.completion_ids.shape[1], out.completion_mask.bool()
    with torch.no_grad(), (record_routing(model) if is_moe(model) else nullcontext()) as trace:
        trainer, _ = token_logprobs(model, ids, mask, C)
    difference = {}
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        engine = RolloutEngine(model, RolloutConfig(engine=EngineConfig(precision=precision)))
        for mine, theirs in zip(engine.model.parameters(), model.parameters()):
            assert torch.equal(mine, theirs.to(dtype))
        with torch.no_grad(), (replay_routing(engine.model, trace) if trace is not None else nullcontext()):
            engine_logp, _ = token_logprobs(engine.model, ids, mask, C)
        difference[precision] = (engine_logp.float() - trainer).abs()[tokens].mean()
    assert 0 < difference["fp16"] < difference["bf16"] / 4


def test_the_default_engine_is_the_trainer_and_a_bf16_engine_follows_its_updates():
    model, _ = TinyModel(arch="qwen3_moe", config=TINY_MOE).load()
    assert RolloutEngine(model, RolloutConfig(engine=EngineConfig())).model is model  # no copy, nothing to sync
    engine = RolloutEngine(model, RolloutConfig(engine=EngineConfig(precision="bf16")))
    assert engine.model is not model and next(engine.model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)  # an update
    assert not torch.equal(next(engine.model.parameters()), next(model.parameters()).to(torch.bfloat16))
    engine.sync()
    for mine, theirs in zip(engine.model.parameters(), model.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16))


def run_metrics(compose, rl_overrides, *overrides):
    run, module, _ = build(compose(rl_overrides + ["train.minibatches=1", *overrides]))
    run.trainer.fit(module)
    return module.history[:2]  # the two RL steps


def test_mismatch_is_zero_for_the_default_engine_and_grows_with_fp16_then_bf16_rollouts(compose, rl_overrides):
    for row in run_metrics(compose, rl_overrides):
        assert row["mismatch/kl"] < 1e-8 and row["mismatch/extreme_frac"] == 0
        assert row["routing/rollout_disagreement"] == 0 and row["routing/rollout_disagreement_tokens"] == 0
        assert abs(row["ratio/seq/max"] - 1) <= RATIO_ROUNDING  # π_old is the engine's, and the engine is the trainer
    bf16 = run_metrics(compose, rl_overrides, "rollout.engine.precision=bf16")
    for row in bf16:
        assert row["mismatch/kl"] > 1e-8 and row["mismatch/seq_log_ratio_abs"] > 1e-5
        assert row["time/engine_sync_s"] > 0
    for row, bf16_row in zip(run_metrics(compose, rl_overrides, "rollout.engine.precision=fp16"), bf16):
        # k3 ~ Δ²/2 and fp16's Δ is about 8 times smaller: 64 times less expected, 42-54 measured, 8 asserted
        assert 0 < row["mismatch/kl"] < bf16_row["mismatch/kl"] / 8


def test_without_replay_the_first_minibatchs_forwards_measure_what_a_forward_of_their_own_would(compose,
                                                                                              rl_overrides):
    """The mismatch and the routing before the updates, taken from the first mini-batch's training forwards (two
    micro-batches, gradients on), equal a no-grad forward of their own on the same rows before the update (the
    measurement gspo-lab ran until then, and still runs under replay), with a bf16 engine and router noise so
    that there is a mismatch to measure; the routing change after the updates is measured on those rows."""
    run, module, _ = build(compose(rl_overrides + ["rollout.engine.precision=bf16", "rollout.engine.router_noise=0.3",
                                                   "train.micro_batch_size=4", "train.steps=1",
                                                   "routing.diagnostics_rows=8"]))  # the 8-row first mini-batch
    own: list[dict[str, float]] = []
    accumulate, own_forward = module.updater.accumulate, module.probe.own_forward

    def no_forward_of_its_own(batch, step):
        assert own_forward(batch, step) == {}, "a forward of its own ran"
        return {}

    def measured_first(minibatch, ranks, step, before=None):
        if not own:  # the first mini-batch, weights as at generation: a forward of its own first
            train_logp, metrics = module.routing.before_update(minibatch, module.policy.shared_logprobs)
            own.append({**metrics, **engine_mismatch(minibatch, train_logp)})
        return accumulate(minibatch, ranks, step, before)

    module.probe.own_forward, module.updater.accumulate = no_forward_of_its_own, measured_first
    run.trainer.fit(module)
    step = module.history[0]
    sixteen_rows = SimpleNamespace(rewards=torch.zeros(16))  # 2 mini-batches of 8
    assert module.probe.in_update(sixteen_rows)
    module.routing.diagnostics_rows = 9  # more rows than the first mini-batch holds: a forward of their own
    assert not module.probe.in_update(sixteen_rows)
    assert len(own) == 1 and own[0]["mismatch/kl"] > 1e-6 and own[0]["routing/rollout_disagreement"] > 0.01
    for key, value in own[0].items():
        # the same operations on the same rows, with and without autograd: equal to float rounding
        assert step[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
    assert "routing/changed_frac" in step and step["routing/changed_frac"] >= 0


def test_router_noise_moves_the_engines_experts_and_r3_replays_them(compose, rl_overrides):
    """σ = 0.5 of the logits' spread changes many top-2 choices during generation; under r3 the training
    forward uses those experts, so replay overrides the trainer's own choice about as often."""
    rows = run_metrics(compose, rl_overrides, "rollout.engine.router_noise=0.5", "routing.replay=r3")
    for row in rows:
        assert row["routing/rollout_disagreement"] > 0.05
        assert row["routing/override_frac"] > 0.05  # the first (only) mini-batch: weights as at generation
        assert not math.isnan(row["mismatch/kl"])


def test_token_tis_corrects_a_trainer_pi_old_toward_a_bf16_engine(compose, rl_overrides):
    rows = run_metrics(compose, rl_overrides, "algorithm=grpo", "rollout.engine.precision=bf16",
                       "rollout.logprobs_from_generation=false", "objective.rollout_correction=tis_token")
    for row in rows:
        assert row["is/weight_mean"] != 1 and 0 <= row["is/capped_frac"] <= 1
        assert abs(row["ratio/token/max"] - 1) <= RATIO_ROUNDING  # π_old is the trainer's: the PPO ratio is on-policy


def trainer_precision_context(precision: str):
    """The context Lightning runs `training_step` (and so generation) in under `trainer.precision` on CPU: none
    under 32-true, its MixedPrecision plugin's autocast otherwise (16-mixed: float16 autocast, as on a GPU)."""
    if precision == "32-true":
        return nullcontext()
    return MixedPrecision(precision, "cpu").train_step_context()


@pytest.mark.parametrize("trainer_precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("precision, dtype, error", [("fp16", torch.float16, 0.0), ("bf16", torch.bfloat16, 2**-10)])
def test_the_engine_multiplies_in_its_own_precision_under_every_trainer_precision(trainer_precision, precision,
                                                                                    dtype, error):
    """One weight w = 1 + 2^-10 times x = 1, float64 reference 1 + 2^-10. float16 (10 mantissa bits) holds w
    exactly: error 0. bfloat16 (7 bits) rounds it to 1: error 2^-10. Under bf16-mixed's autocast an fp16 engine
    would multiply in bfloat16 (output bfloat16, error 2^-10); under 16-mixed a bf16 engine in float16."""
    trainer_model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        trainer_model.weight.fill_(1 + 2**-10)
    engine = RolloutEngine(trainer_model, RolloutConfig(engine=EngineConfig(precision=precision)))
    x = torch.ones(1, 1, dtype=dtype)  # [1, 1]: the engine's activations are in its dtype (its embeddings')
    with trainer_precision_context(trainer_precision), engine.generating():
        out = engine.model(x)  # [1, 1]
    reference = trainer_model.weight.double() @ x.double()  # [1, 1]
    assert out.dtype == dtype
    assert (out.double() - reference).abs().item() == error


@pytest.mark.parametrize("trainer_precision", ["bf16-mixed", "16-mixed"])
def test_an_fp16_engine_generates_and_caches_in_float16_under_mixed_precision(tiny_family, trainer_precision):
    """The same seeds give the same completions and engine log-probs under every trainer precision, and every
    key and value the engine caches is float16 (under bf16 autocast they became float32)."""
    model, tokenizer = tiny_family("tiny_dense")
    engine = RolloutEngine(model, RolloutConfig(engine=EngineConfig(precision="fp16")))
    seeds = torch.arange(len(PROMPTS))
    cached: set[torch.dtype] = set()

    def keep_cache_dtypes(module, args, output):
        cached.update(tensor.dtype for layer in output.cache.layers for tensor in (layer.keys, layer.values))

    outs = {}
    with engine.model.register_forward_hook(keep_cache_dtypes):
        for context in ("32-true", trainer_precision):
            with trainer_precision_context(context), engine.generating():
                outs[context] = generate(engine.model, tokenizer, PROMPTS, 6, return_logprobs=True, row_seeds=seeds)
    assert cached == {torch.float16}
    assert torch.equal(outs["32-true"].completion_ids, outs[trainer_precision].completion_ids)
    assert torch.equal(outs["32-true"].logprobs, outs[trainer_precision].logprobs)


def test_the_backend_setting_and_its_old_logprobs_default(compose, tmp_path):
    """hf takes π_old from its engine, which is the trainer (exact); vllm (any other backend) from a trainer
    forward, as TRL and verl. A backend no registry line names is refused at plan time."""
    assert RolloutConfig().logprobs_from_generation is True
    assert RolloutConfig(backend="vllm").logprobs_from_generation is False
    assert RolloutConfig(backend="vllm", logprobs_from_generation=True).logprobs_from_generation is True
    with pytest.raises(ConfigError, match=r"rollout.backend='sglang' is invalid: must be one of \['hf', 'vllm', 'replay'\]"):
        plan(compose(["rollout.backend=sglang", f"paths.output_dir={tmp_path}"]))
    with pytest.raises(ValueError, match=r"rollout.vllm.gpu_memory_utilization=1.5 is invalid"):
        VLLMConfig(gpu_memory_utilization=1.5)


@pytest.mark.skipif(vllm_setup.available(), reason="vLLM is installed here (make test-vllm tests the backend)")
def test_the_vllm_backend_without_vllm_names_the_extra_to_install(compose, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.backend=vllm needs vLLM: pip install -e '.\[vllm\]' on a GPU node"):
        plan(compose(["rollout.backend=vllm", f"paths.output_dir={tmp_path}"]))


@pytest.mark.parametrize("overrides, from_generation", [
    ([], True),  # the engine is the trainer: its log-probs are the forward's
    (["rollout.engine.precision=bf16"], False),
    (["rollout.engine.weight_bits=8"], False),
    (["rollout.engine.router_noise=0.1"], False),
    (["rollout.engine.precision=bf16", "rollout.logprobs_from_generation=true"], True),  # the §5.4 mode, as asked
])
def test_old_logprobs_default_to_the_engines_only_where_the_engine_is_the_trainer(overrides, from_generation,
                                                                                  compose, tmp_path):
    """rollout.logprobs_from_generation=null: a simulated engine's log-probs would silently become π_old."""
    rollout = plan(compose(overrides + [f"paths.output_dir={tmp_path}"])).rollout
    assert rollout.logprobs_from_generation is from_generation
