"""gspo-train end to end on the tiny MoE: every algorithm learns something, every column is written,
resume is exact, runs are deterministic and paired across algorithms."""

import csv
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.cold_start import policy_from_config
from gspo_lab.step.updater import Updater
from gspo_lab.rollout import logprobs
from gspo_lab.rewards import build_rewards
from gspo_lab.tasks import HFDataset
from gspo_lab.train import build, train, warn_inexact_old_logprobs, warn_latex_only_reward
from tests.numerics import RATIO_ROUNDING

CONTRACT_COLUMNS = [
    "step", "reward/mean", "reward/std", "reward/frac_zero_std", "eval/accuracy", "clip/frac", "clip/frac_low",
    "clip/frac_high", "clip/seq_frac", "ratio/seq/mean", "ratio/seq/max", "ratio/token/max", "kl/old", "entropy", "completion/len_mean",
    "completion/truncated_frac", "grad_norm", "time/rollout_s", "time/update_s", "throughput/tokens_per_s",
]
TIMING = ("time/", "throughput/")


def read_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def without_timing(rows):
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_each_algorithm_runs_and_changes_the_parameters(algorithm, compose, rl_overrides, tmp_path):
    cfg = compose(rl_overrides + [f"algorithm={algorithm}"])
    start, _, _ = policy_from_config(cfg, instantiate(cfg.task))
    summary = train(cfg)
    run = tmp_path / "run"
    trained, _ = instantiate(cfg.model).load_from(run / "final")
    changed = [n for (n, a), b in zip(start.named_parameters(), trained.parameters()) if not torch.equal(a, b)]
    assert changed, "no parameter moved"
    assert summary["steps"] == 2 and (run / "reward_curve.png").stat().st_size > 1000
    rows = read_rows(run)
    assert [r["step"] for r in rows] == ["0", "1", "2"]  # two RL steps, then the final evaluation row
    assert set(CONTRACT_COLUMNS) <= set(rows[0])
    assert float(rows[0]["grad_norm"]) > 0 and 0 <= float(rows[0]["clip/frac"]) <= 1
    info = json.loads((run / "run_info.json").read_text())
    assert info["versions"]["torch"].startswith("2.") and info["git_sha"]
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()


COMPOSED = sorted({p.stem for p in (Path(CONFIG_DIR) / "objective").glob("*.yaml")} - {"gspo", "gspo_token", "grpo"})


@pytest.mark.parametrize("algorithm", COMPOSED)
def test_each_composed_objective_trains_and_changes_the_parameters(algorithm, compose, rl_overrides, tmp_path):
    """Every objective composed in conf/objective/*.yaml runs through gspo-train: two RL steps move the policy,
    the loss and gradient are finite, and the run is labelled with the objective's name."""
    cfg = compose(rl_overrides + [f"algorithm={algorithm}"])
    start, _, _ = policy_from_config(cfg, instantiate(cfg.task))
    summary = train(cfg)
    trained, _ = instantiate(cfg.model).load_from(tmp_path / "run" / "final")
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), trained.parameters())), "no parameter moved"
    rows = read_rows(tmp_path / "run")
    assert summary["algorithm"] == algorithm and summary["steps"] == 2
    assert all(0 < float(r["grad_norm"]) < float("inf") for r in rows[:2])


def test_same_seed_gives_identical_metrics(compose, rl_overrides, tmp_path):
    first = compose(rl_overrides)
    train(first)
    again = compose(rl_overrides + [f"paths.output_dir={tmp_path / 'again'}"])
    train(again)
    assert without_timing(read_rows(tmp_path / "run")) == without_timing(read_rows(tmp_path / "again"))


def test_algorithms_share_prompts_and_first_rollout(compose, rl_overrides, tmp_path):
    rows = {}
    for algorithm in ("gspo", "grpo"):
        train(compose(rl_overrides + [f"algorithm={algorithm}", f"paths.output_dir={tmp_path / algorithm}"]))
        rows[algorithm] = read_rows(tmp_path / algorithm)[0]
    for key in ("reward/mean", "reward/std", "completion/len_mean", "eval/accuracy"):
        assert rows["gspo"][key] == rows["grpo"][key], key
    assert rows["gspo"]["clip/frac"] != rows["grpo"]["clip/frac"]  # ... but different objectives


@pytest.mark.parametrize("sampling", [[], ["rollout.filter_zero_std_groups=true", "rollout.group_size=2",
                                          "rollout.prompts_per_step=8"],
                                      ["model.lora.enabled=true", "model.lora.rank=4", "objective.beta=0.04"]],
                         ids=["plain", "dynamic_sampling", "lora"])
def test_resume_continues_to_exactly_the_uninterrupted_metrics(sampling, compose, rl_overrides, tmp_path):
    full = rl_overrides + sampling + ["train.steps=4", "train.eval_every=2"]
    train(compose(full + [f"paths.output_dir={tmp_path / 'full'}"]))
    train(compose(full + ["train.steps=2", f"paths.output_dir={tmp_path / 'part'}"]))
    resumed = full + [f"paths.output_dir={tmp_path / 'resumed'}", f"ckpt_path={tmp_path / 'part/checkpoints/last.ckpt'}"]
    train(compose(resumed))
    uninterrupted = without_timing(read_rows(tmp_path / "full"))
    continued = without_timing(read_rows(tmp_path / "resumed"))
    assert [r["step"] for r in continued] == ["2", "3", "4"]
    assert continued == uninterrupted[2:]


@pytest.mark.parametrize(
    "overrides, mode",
    [(["algorithm=grpo_rr"], "r2"), (["algorithm=gspo", "routing.replay=r3"], "r3"), (["algorithm=grpo"], "off")],
)
def test_routing_modes_run_and_log_diagnostics(overrides, mode, compose, rl_overrides, tmp_path):
    train(compose(rl_overrides + overrides))
    rows = read_rows(tmp_path / "run")[:2]
    for row in rows:
        assert 0 <= float(row["routing/changed_frac"]) <= float(row["routing/changed_tokens_frac"]) <= 1
        assert "routing/changed_frac/layer_0" in row
        assert (row.get("routing/override_frac") not in (None, "")) == (mode != "off")
    assert float(rows[0]["routing/trace_bytes_per_token"]) == 1 * 2 + 1  # one layer, top-2, uint8 + flag


@pytest.mark.parametrize("mode", ["off", "r3"])
def test_diagnostics_every_k_steps_run_their_forwards_on_those_steps_only(mode, compose, rl_overrides, tmp_path):
    """routing.diagnostics_every=2 over 3 RL steps: the routing change after the updates (and under r3 the
    mismatch's forward of its own) on steps 0 and 2 only; override_frac, and without replay the mismatch measured
    on the first mini-batch's forwards, every step."""
    run, module, _ = build(compose(rl_overrides + ["routing.diagnostics_every=2", "train.steps=3",
                                                   "routing.diagnostics_rows=8", f"routing.replay={mode}"]))
    forwards = {"before": 0}
    before_update = module.routing.before_update  # the probe's forward of its own
    module.routing.before_update = lambda *args: forwards.__setitem__("before", forwards["before"] + 1) or \
        before_update(*args)
    run.trainer.fit(module)
    steps = [row for row in module.history if "reward/mean" in row]
    assert [("routing/changed_frac" in row) for row in steps] == [True, False, True]
    assert all(("mismatch/kl" in row) == (mode == "off" or i != 1) for i, row in enumerate(steps))
    assert all(("routing/override_frac" in row) == (mode == "r3") for row in steps)
    assert forwards["before"] == (2 if mode == "r3" else 0)
    # what they measure is unchanged: every value equals the same seed's run diagnosing every step (timings aside)
    run, every, _ = build(compose(rl_overrides + ["train.steps=3", "routing.diagnostics_rows=8",
                                                  f"routing.replay={mode}", f"paths.output_dir={tmp_path / 'every'}"]))
    run.trainer.fit(every)
    for spaced, each in zip(steps, [row for row in every.history if "reward/mean" in row], strict=True):
        assert {k: v for k, v in spaced.items() if not k.startswith(("time/", "throughput/"))} == \
            {k: each[k] for k in spaced if not k.startswith(("time/", "throughput/"))}
    assert "routing/changed_frac" in each and steps[2]["routing/changed_frac"] == each["routing/changed_frac"]


def test_r2_cannot_take_old_logprobs_from_generation(compose, rl_overrides):
    with pytest.raises(ValueError, match="routing.replay='r2' is invalid: r2 records experts in the old-policy"):
        train(compose(rl_overrides + ["algorithm=grpo_rr", "rollout.logprobs_from_generation=true"]))


# stochastic regularisers that eval mode turns off in generation and in every log-prob forward alike
REGULARISERS = {
    "none": [],
    "attention_dropout": ["+model.config.attention_dropout=0.5"],
    "mixtral_router_jitter": ["model=tiny_mixtral", "model.config.intermediate_size=32",
                              "+model.config.attention_dropout=0.5", "+model.config.router_jitter_noise=0.5"],
}


def assert_on_policy(run_dir):
    """Each RL step's only update saw GSPO sequence ratios of 1 up to float rounding and clipped nothing."""
    for row in read_rows(run_dir)[:2]:  # the two RL steps
        assert abs(float(row["ratio/seq/max"]) - 1) <= RATIO_ROUNDING
        assert abs(float(row["ratio/seq/min"]) - 1) <= RATIO_ROUNDING
        assert float(row["clip/frac"]) == 0


@pytest.mark.parametrize(("from_generation", "device", "precision", "warned"), [
    (True, "cuda", "bf16-mixed", True), (True, "cuda", "16-mixed", True), (True, "cuda", "bf16-true", True),
    (True, "cuda", "32-true", False), (True, "cpu", "bf16-mixed", False), (False, "cuda", "bf16-mixed", False),
])
def test_generation_logprobs_on_a_gpu_in_16_bit_are_warned_about(from_generation, device, precision, warned, caplog):
    """Measured on an H100: π_old from the decode kernels is off by more than GSPO's clip range in bf16; on CPU
    (exact under bf16 autocast too) and in float32, or with a forward of its own, nothing is said."""
    with caplog.at_level(logging.WARNING, logger="gspo_lab.plan"):
        assert warn_inexact_old_logprobs(from_generation, device, precision) is warned
    assert ("rollout.logprobs_from_generation=false" in caplog.text) is warned


@pytest.mark.parametrize(("functions", "match", "warned"), [
    ([{"_target_": "gspo_lab.rewards.math_accuracy"}], "math_verify", True),  # TRL's default: LaTeX only
    ([{"_target_": "gspo_lab.rewards.math_accuracy", "latex_only": True}], "math_verify", True),
    ([{"_target_": "gspo_lab.rewards.math_accuracy", "latex_only": False}], "math_verify", False),
    ([{"_target_": "gspo_lab.rewards.math_accuracy"}], "numeric", False),  # the checker reads the last number
    ([{"_target_": "gspo_lab.rewards.TaskReward"}], "math_verify", False),  # the checker itself
])
def test_a_latex_only_reward_beside_a_checker_reading_plain_answers_is_warned_about(functions, match, warned, caplog):
    """"The answer is 42" scored 0 in training (reward=math_verify) and counted in eval/accuracy (task=hf)."""
    task = HFDataset(rows=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)], match=match)
    with caplog.at_level(logging.WARNING, logger="gspo_lab.plan"):
        assert warn_latex_only_reward(build_rewards({"functions": functions, "num_workers": 0}, task), task) is warned
    assert ("latex_only=false to measure the same thing" in caplog.text) is warned


@pytest.mark.parametrize("shared", [False, True], ids=["as_configured", "every_forward_shares_prompts"])
@pytest.mark.parametrize("overrides", [["algorithm=grpo_rr"],
                                       ["algorithm=grpo", "routing.replay=r3", "rollout.logprobs_from_generation=true"]])
@pytest.mark.numerics
def test_replay_on_the_first_mini_batch_overrides_nothing_and_ratios_are_one(overrides, shared, compose, rl_overrides,
                                                                             monkeypatch):
    """The first mini-batch runs the weights that recorded the experts (the old-policy forward for r2,
    generation for r3): replay then overrides no expert choice and every GRPO token ratio is 1; also when every
    forward runs each prompt once (these batches are below the token floor that normally prevents it)."""
    shared_calls = []
    if shared:
        monkeypatch.setattr(logprobs, "MIN_SAVED_TOKENS", 0)
        real = logprobs.shared_prompt_hidden

        def counted(*args):
            hidden = real(*args)
            shared_calls.append(hidden is not None)
            return hidden

        monkeypatch.setattr(logprobs, "shared_prompt_hidden", counted)
    run, module, _ = build(compose(rl_overrides + overrides + ["train.minibatches=1", "train.steps=1"]))
    run.trainer.fit(module)
    assert all(shared_calls) and len(shared_calls) >= 2 * shared  # the replayed update's forward among them
    first = module.history[0]
    assert first["routing/override_frac"] == 0
    assert abs(first["ratio/token/max"] - 1) <= RATIO_ROUNDING and abs(first["ratio/token/min"] - 1) <= RATIO_ROUNDING
    assert first["clip/frac"] == 0
    assert first["grad_norm"] > 0  # an update really ran under replay


def test_a_run_is_labelled_by_what_runs_not_by_the_algorithm_default(rl_overrides, tmp_path):
    """`gspo-train objective=grpo` (no `algorithm=`) runs GRPO while Hydra's `algorithm` choice stays at its
    default, gspo: summary.json and run_info.json must say grpo."""
    overrides = rl_overrides + ["objective=grpo"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        hydra_cfg = hydra_compose(config_name="train", overrides=overrides, return_hydra_config=True)
        cfg = hydra_compose(config_name="train", overrides=overrides)
    assert hydra_cfg.hydra.runtime.choices.algorithm == "gspo"  # what the old label was read from
    HydraConfig.instance().set_config(hydra_cfg)  # as under gspo-train
    try:
        summary = train(cfg)
    finally:
        HydraConfig.instance().cfg = None
    run = tmp_path / "run"
    assert summary["algorithm"] == "grpo"
    assert json.loads((run / "summary.json").read_text())["algorithm"] == "grpo"
    assert json.loads((run / "run_info.json").read_text())["algorithm"] == "grpo"


def test_kl_penalty_to_the_reference_policy_runs_and_changes_the_update(compose, rl_overrides, tmp_path):
    """objective.beta > 0 builds a frozen copy of the starting policy: kl/ref is exactly 0 at the first update
    (policy = reference), positive after it, and the penalty changes the next update (its gradient is 0 at
    ratio 1, so the first update is the same as without it). Attention dropout is configured: the reference
    runs in eval mode like the policy, or kl/ref would not start at 0."""
    one_update = rl_overrides + ["train.minibatches=1", "+model.config.attention_dropout=0.5"]
    summary = train(compose(one_update + ["objective.beta=0.5"]))
    rows = read_rows(tmp_path / "run")
    assert float(rows[0]["kl/ref"]) == 0.0 and float(rows[1]["kl/ref"]) > 0
    assert float(rows[0]["time/ref_logprobs_s"]) > 0 and summary["steps"] == 2
    train(compose(one_update + [f"paths.output_dir={tmp_path / 'no_kl'}"]))
    plain = read_rows(tmp_path / "no_kl")
    assert "kl/ref" not in plain[0] and "time/ref_logprobs_s" not in plain[0]
    assert plain[0]["grad_norm"] == rows[0]["grad_norm"]  # the same first update...
    assert plain[1]["loss/total"] != rows[1]["loss/total"]  # ... then the penalty enters the loss
    model_source = instantiate(compose(one_update).model)
    with_kl, _ = model_source.load_from(tmp_path / "run" / "final")
    without, _ = model_source.load_from(tmp_path / "no_kl" / "final")
    assert any(not torch.equal(a, b) for a, b in zip(with_kl.parameters(), without.parameters()))


def test_without_the_kl_penalty_no_reference_is_built(compose, rl_overrides):
    _, module, _ = build(compose(rl_overrides))
    assert module.reference is None
    _, module, _ = build(compose(rl_overrides + ["objective.beta=0.04"]))
    assert module.reference is not None and not any(p.requires_grad for p in module.reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(module.model.parameters(), module.reference.parameters()))


@pytest.mark.parametrize("replay", ["algorithm=grpo_rr", "routing.replay=r3"])
def test_the_reference_routes_with_its_own_routers_under_replay(replay, compose, rl_overrides, tmp_path):
    """Replay hooks only the policy's routers; the reference computes its own routing, so the KL measures the
    distance between the two policies as each runs."""
    run, module, _ = build(compose(rl_overrides + [replay, "objective.beta=0.04"]))
    start = [p.clone() for p in module.model.parameters()]
    run.trainer.fit(module)
    assert module.history[1]["kl/ref"] > 0 and "routing/override_frac" in module.history[1]
    assert all(torch.equal(a, b) for a, b in zip(start, module.reference.parameters()))  # frozen
    assert not all(torch.equal(a, b) for a, b in zip(start, module.model.parameters()))  # while the policy moved


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_mask_truncated_leaves_truncated_completions_out_of_the_loss(mask_truncated, compose, rl_overrides):
    """With a 3-token budget, the 3- and 4-digit sums plus EOS do not fit: completions are truncated. Masked,
    each truncated row is an empty row of the loss (mask/empty_rows counts them per mini-batch)."""
    run, module, _ = build(compose(rl_overrides + ["rollout.max_new_tokens=3", f"rollout.mask_truncated={mask_truncated}"]))
    run.trainer.fit(module)
    for row in module.history[:2]:
        truncated = row["completion/truncated_frac"] * 16  # 4 prompts x 4 completions
        assert truncated > 0
        empty = row["mask/empty_rows"] * 2  # the mean over 2 mini-batches -> the total
        assert empty == (truncated if mask_truncated else 0)
        tokens, valid = row["completion/len_mean"] * 16, row["mask/valid_tokens"] * 2
        assert valid < tokens if mask_truncated else valid == pytest.approx(tokens)


def with_model(rl_overrides, overrides):
    """rl_overrides for another model: the tiny MoE's expert width is not a key of every architecture."""
    if any(o.startswith("model=") for o in overrides):
        rl_overrides = [o for o in rl_overrides if not o.startswith("model.config.moe_intermediate_size")]
    return rl_overrides + overrides


@pytest.mark.numerics
@pytest.mark.parametrize("regulariser", sorted(REGULARISERS))
@pytest.mark.parametrize("from_generation", [True, False])
def test_an_on_policy_update_sees_sequence_ratios_of_one(from_generation, regulariser, compose, rl_overrides,
                                                          tmp_path):
    """One mini-batch per rollout makes the only update on-policy: every GSPO sequence ratio is 1 up to float
    rounding (far inside the 3e-4 clip), whether old log-probs come from generation or from a forward, and with
    dropout or router jitter configured (off in both: the whole run is in eval mode)."""
    overrides = ["train.minibatches=1", f"rollout.logprobs_from_generation={from_generation}"]
    train(compose(with_model(rl_overrides, REGULARISERS[regulariser] + overrides)))
    assert_on_policy(tmp_path / "run")


@pytest.mark.numerics
def test_nucleus_sampling_keeps_on_policy_ratios_of_one(compose, rl_overrides, tmp_path):
    """rollout.top_p < 1 filters what is sampled, but the old log-probs from generate's raw logits and the update's
    are both the un-truncated log softmax(logits / T), so the on-policy ratio is still 1."""
    train(compose(rl_overrides + ["rollout.top_p=0.9", "train.minibatches=1", "rollout.logprobs_from_generation=true"]))
    assert_on_policy(tmp_path / "run")


def test_gradient_checkpointing_changes_no_metric(compose, rl_overrides, tmp_path):
    """Checkpointing recomputes blocks in the backward pass (in eval mode too): the same run, the same numbers.
    (A checkpointed model runs no shared-prompt forward, so neither run does: that one changes float rounding.)"""
    dropout = rl_overrides + REGULARISERS["attention_dropout"] + ["train.share_prompt_forward=false"]
    train(compose(dropout))
    train(compose(dropout + ["model.gradient_checkpointing=true", f"paths.output_dir={tmp_path / 'checkpointed'}"]))
    assert without_timing(read_rows(tmp_path / "run")) == without_timing(read_rows(tmp_path / "checkpointed"))


class GradientNorms(L.Callback):
    """The norm of the gradients each optimizer step applies (Lightning calls this hook inside the step)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(torch.nn.utils.get_total_norm(grads).item())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gradients_are_clipped_to_grad_clip_with_the_fused_optimizer(precision, compose, rl_overrides):
    """Clipping by the norm the step logs; under bf16-mixed with fused AdamW too, which Lightning's own
    clip_gradients refuses (Lightning issue #21435), so trainer=gpu crashed on its first update before."""
    run, module, _ = build(compose(rl_overrides + [f"trainer.precision={precision}", "train.grad_clip=0.01",
                                                   "optimizer.fused=true"]))
    applied = GradientNorms()
    run.trainer.callbacks.append(applied)
    run.trainer.fit(module)
    assert len(applied.norms) == 4  # 2 RL steps x 2 mini-batches
    logged = [row["grad_norm"] for row in module.history if "grad_norm" in row]  # the final row: evaluation only
    assert len(logged) == 2 and min(logged) > 0.1  # the clip binds ...
    assert applied.norms == pytest.approx([0.01] * 4, rel=1e-4)  # ... and each step applies the clipped gradients


@pytest.mark.parametrize("norm", [0.5, 0.999999, 1.0, 1.0000005, 2.0, 1e30])
def test_gradients_are_scaled_exactly_when_torch_would_scale_them_by_less_than_1(norm):
    """Updater.clips skips clip_grads_with_norm_ only where torch would multiply by exactly 1: its factor is
    min(1, clip / (norm + 1e-6)), so a norm just below the clip (within 1e-6) is scaled too."""
    for dtype in (torch.float32, torch.float64):
        grad_norm = torch.tensor(norm, dtype=dtype)
        factor = torch.clamp(1.0 / (grad_norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grads_with_norm_'s own
        assert Updater.clips(SimpleNamespace(train_cfg=SimpleNamespace(grad_clip=1.0)), grad_norm) == bool(factor < 1)
    assert Updater.clips(SimpleNamespace(train_cfg=SimpleNamespace(grad_clip=0.0)), grad_norm) is False  # no clipping


@pytest.mark.parametrize("lora", [False, True])
def test_training_16_bit_weights_warns_unless_adapters_train(lora, compose, rl_overrides, caplog):
    """bfloat16 weights lose AdamW steps below their spacing; PEFT's adapters stay float32 on a bfloat16 base."""
    _, module, _ = build(compose(rl_overrides + ["model.dtype=bfloat16", f"model.lora.enabled={lora}"]))
    with caplog.at_level(logging.WARNING, logger="gspo_lab.step.updater"):
        module.configure_optimizers()
    assert ("the trained weights are bfloat16 (model.dtype)" in caplog.text) is not lora


def test_old_logprobs_from_generation_run_with_r3(compose, rl_overrides, tmp_path):
    summary = train(compose(rl_overrides + ["rollout.logprobs_from_generation=true", "routing.replay=r3"]))
    assert summary["steps"] == 2 and float(read_rows(tmp_path / "run")[0]["routing/override_frac"]) >= 0
