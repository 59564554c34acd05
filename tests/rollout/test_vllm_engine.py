"""rollout.backend=vllm against vLLM's CPU build (make test-vllm): the engine's log-probs are the trainer's after
every weight sync (dense and MoE) and on every step of a run, a stale engine is caught, the samples follow their
seeds whatever the batching, evaluation generates through it, two DDP ranks each run an engine, a run learns as
on transformers, and what vLLM cannot run here is refused before anything trains. Skipped where vLLM is not
installed."""

import json
import logging
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from gspo_lab.eval_sets import evaluation_backend
from gspo_lab.rollout import token_logprobs
from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.sampling import draw_row_seeds
from gspo_lab.rollout.vllm.engine import VLLMEngine
from gspo_lab.rollout.vllm.experts import Captured
from gspo_lab.rollout.vllm.setup import BUFFERS_SYNCED
from gspo_lab.rollout.vllm.weights import (
    NarrowingLoadFilter,
    checkpoint_weights,
    persistent_buffer_names,
    reload_in_worker,
)
from gspo_lab.train import ConfigError, build, plan
from tests.test_fsdp import rows as run_rows
from tests.test_fsdp import run_two_processes

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

VLLM = ["rollout.backend=vllm"]
PROMPTS = ["12+34=", "5+6=", "70+8=", "9+90="]
# float32 log-probs of a few units from two implementations of the same maths (vLLM's packed oneDNN GEMMs and
# its attention kernel against transformers'): a few hundred float32 eps; measured 4.8e-7
ROUNDING = 1e-5
TINY = {"tiny_dense": ["model.config.num_hidden_layers=1", "model.config.hidden_size=64",
                       "model.config.intermediate_size=128"],
        "tiny_moe": ["model.config.num_hidden_layers=1", "model.config.hidden_size=64",
                     "model.config.moe_intermediate_size=32"]}
# LoRA on the attention projections, the router's gate and the expert banks: each wrapped weight is synced merged
LORA = ["model.lora.enabled=true", "model.lora.experts=true", "model.lora.rank=4", "optimizer.lr=0.01"]
# the adapters alone, served by vLLM's LoRA: on the attention projections of a dense model (vLLM's LoRA covers
# linear layers; on CPU it cannot wrap a MoE layer)
LORA_ADAPTER = ["model.lora.enabled=true", "model.lora.rank=4", "optimizer.lr=0.01", "rollout.vllm.lora_sync=adapter"]
# the families of the architectures whose persistent buffers a sync is shown to reach
# (gspo_lab.rollout.vllm.setup.BUFFERS_SYNCED)
BUFFERS_SYNCED_FAMILIES = {"tiny_glm4_moe": "Glm4MoeForCausalLM", "tiny_exaone_moe": "ExaoneMoeForCausalLM"}


def rollout_sampling(module) -> Sampling:
    """How the module's RL rollouts sample."""
    return Sampling.of_rollout(module.rollout_cfg, module.render.add_special_tokens)


def engine_gap(module, seeds: torch.Tensor) -> float:
    """The largest |engine log-prob - trainer log-prob| over the tokens the engine samples for PROMPTS."""
    generated = module.engine.generate(module.tokenizer, PROMPTS, rollout_sampling(module), seeds)
    completions = generated.completions
    assert generated.routing_trace is None and completions.completion_mask.sum() > len(PROMPTS)
    input_ids = torch.cat([completions.prompt_ids, completions.completion_ids], 1)
    mask = torch.cat([completions.prompt_mask, completions.completion_mask], 1)
    with torch.no_grad():
        trainer, _ = token_logprobs(module.model, input_ids, mask, completions.completion_ids.shape[1],
                                   module.rollout_cfg.temperature)
    return ((completions.logprobs - trainer) * completions.completion_mask).abs().max().item()


@pytest.mark.parametrize("model, lora", [("tiny_dense", []), ("tiny_moe", []), ("tiny_moe", LORA),
                                         ("tiny_dense", LORA_ADAPTER)],
                         ids=["dense", "moe", "moe_lora", "dense_adapter"])
def test_the_engine_samples_with_the_trainers_weights_after_every_sync(model, lora, compose, rl_overrides):
    """At step 0 and after 3 optimizer updates the engine's log-probs of its own samples are the trainer's to
    float32 rounding; between the updates and the next sync they are not (the check sees a stale engine). On CPU
    vLLM packs every Linear (and a MoE's expert banks) for its kernels at load: a sync that misses them fails. With
    LoRA only the adapters train, and the engine gets each wrapped weight merged, W + scale·BA, or (lora_sync=adapter)
    the adapters alone, which it serves on the base weights of its first sync."""
    tiny = [o for o in rl_overrides if not o.startswith("model.")] + [f"model={model}", *TINY[model], *lora]
    run, module, _ = build(compose(tiny + VLLM + ["train.steps=1", "train.minibatches=3", "rollout.prompts_per_step=3",
                                                  "train.eval_every=0"]))
    seeds = draw_row_seeds(len(PROMPTS))
    try:
        module.engine.sync()
        assert engine_gap(module, seeds) <= ROUNDING
        run.trainer.callbacks.append(KeepEngine())
        run.trainer.fit(module)  # one RL step: its rollout syncs, then 3 optimizer updates
        assert engine_gap(module, seeds) > 100 * ROUNDING  # stale: the engine still holds the rollout's weights
        module.engine.sync()
        assert engine_gap(module, seeds) <= ROUNDING
    finally:
        module.close()


class KeepEngine(L.Callback):
    """Keeps the engine past fit (the module's teardown closes it), for the test to look at it afterwards."""

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module.teardown = lambda stage: None


def test_the_samples_follow_their_seeds_whatever_the_batching_and_the_engine(compose, rl_overrides):
    _, module, _ = build(compose(rl_overrides + VLLM))
    generate = lambda engine, prompts, seeds: engine.generate(  # noqa: E731
        module.tokenizer, prompts, rollout_sampling(module), seeds).completions
    seeds = torch.tensor([11, 12, 13, 14])
    try:
        module.engine.sync()
        whole = generate(module.engine, PROMPTS, seeds)
        reversed_ = generate(module.engine, PROMPTS[::-1], seeds.flip(0))
        halves = [generate(module.engine, PROMPTS[:2], seeds[:2]), generate(module.engine, PROMPTS[2:], seeds[2:])]
    finally:
        module.close()
    other = VLLMEngine(module.model, module.rollout_cfg)  # another engine, as a second run starts one
    try:
        other.sync()
        again = generate(other, PROMPTS, seeds)
    finally:
        other.close()
    assert whole.texts == reversed_.texts[::-1] == halves[0].texts + halves[1].texts == again.texts
    assert len(set(whole.texts)) > 1  # the seeds differ, and so do the samples
    torch.testing.assert_close(again.logprobs, whole.logprobs, rtol=0, atol=ROUNDING)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine.precision=bf16"], r"rollout.engine.\* simulates an inference engine on the hf backend"),
    (["rollout.engine.router_noise=0.1"], r"rollout.engine.\* simulates"),
    (["rollout.top_p=0.9"], r"rollout.top_p=0.9 with rollout.backend=vllm: vLLM's log-probs of a top-p sample"),
    (["rollout.vllm.lora_sync=adapter"], r"rollout.vllm.lora_sync=adapter syncs LoRA adapters, and "
                                         r"model.lora.enabled=false"),
    (["model=tiny_moe", "model.lora.enabled=true", "rollout.vllm.lora_sync=adapter"],
     r"rollout.vllm.lora_sync=adapter with model.lora.routers=true: vLLM serves adapters on linear layers"),
    (["model=tiny_moe", "model.lora.enabled=true", "model.lora.routers=false", "rollout.vllm.lora_sync=adapter"],
     r"rollout.vllm.lora_sync=adapter on CPU with a mixture-of-experts model: vLLM's LoRA wraps every MoE layer in a "
     r"Triton kernel"),
    (["rollout.vllm.lora_sync=bundle"], r"rollout.vllm.lora_sync='bundle' is invalid: must be one of"),
    (["model.config.head_dim=16"], r"the model's head size is 16, and vLLM's CPU attention kernels take multiples "
                                   r"of 32"),
    (["model=tiny_moe", "+model.config.architectures=[NotAModelForCausalLM]"], r"vLLM does not serve"),
])
def test_what_vllm_cannot_run_here_is_refused_before_anything_trains(overrides, message, compose, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan(compose(VLLM + overrides + [f"paths.output_dir={tmp_path}"]))


def two_ranks(overrides: list[str], strategy: list[str], run_dir) -> list[dict[str, str]]:
    """A two-step run on two gloo processes (Lightning's DDP or FSDP2 on CPU, tests/test_fsdp.py's launcher), each
    rank with its own engine; its metrics.csv rows."""
    result = run_two_processes([*overrides, "train.steps=2", "train.eval_every=2"], strategy, run_dir, timeout=900)
    assert "GLOBAL_RANK: 1" in result.stdout + result.stderr
    return run_rows(run_dir)


@pytest.mark.slow
def test_two_ddp_ranks_and_two_fsdp_ranks_each_sample_from_an_engine_of_their_own(rl_overrides, tmp_path):
    """Lightning's DDP and FSDP2 on CPU, two gloo processes each: each rank starts its own engine inside the
    trainer's process group (vLLM's external_launcher) and keeps it in sync. Under FSDP2 each sync gathers the
    sharded parameters one at a time (every rank's engine gets the full weights). The engine-trainer mismatch stays
    at float32 rounding on every step (mismatch/kl < 1e-8), DDP's ranks stay identical, and the FSDP2 run's
    metrics are the DDP run's to float rounding (the same seed, the same samples, reductions in another order)."""
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")] + VLLM
    ddp = two_ranks(overrides, ["trainer=ddp"], tmp_path / "ddp")
    fsdp = two_ranks(overrides, ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true"],
                     tmp_path / "fsdp")
    for rows in (ddp, fsdp):
        steps = [row for row in rows if row.get("mismatch/kl")]
        assert len(steps) == 2
        assert all(float(row["mismatch/seq_log_ratio_abs"]) <= ROUNDING and float(row["mismatch/kl"]) < 1e-8
                   for row in steps)
    assert float(ddp[-1]["params/rank_spread"]) == 0
    for row, other in zip(ddp, fsdp):
        assert row["reward/mean"] == other["reward/mean"] and row["completion/len_mean"] == other["completion/len_mean"]
        for key in ("grad_norm", "kl/old", "loss/policy", "eval/accuracy"):
            if row.get(key):
                assert abs(float(row[key]) - float(other[key])) <= 1e-4 * max(1.0, abs(float(row[key]))), key


def test_evaluation_generates_through_the_engine_greedy_as_transformers_does(compose, rl_overrides):
    """Training's evaluation (and gspo-eval) generate with the run's backend: vLLM's greedy completions of the
    held-out prompts are transformers' (float32, the same weights: argmax ties aside)."""
    _, module, _ = build(compose(rl_overrides + VLLM + ["task.eval_size=24"]))
    try:
        backend, on_engine = evaluation_backend(module.engine, module.model, "rollout")
        engine, engine_rows = module.evaluator.run(module.model, module.tokenizer, backend=backend)
        backend, on_trainer = evaluation_backend(module.engine, module.model, "trainer")  # eval.engine=trainer
        hf, hf_rows = module.evaluator.run(module.model, module.tokenizer, backend=backend)
    finally:
        module.close()
    assert (on_engine["eval/engine_vllm"], on_trainer["eval/engine_vllm"]) == (1, 0)
    assert module.engine.llm is None  # started for the evaluation, then closed
    same = sum(e["completion"] == h["completion"] for e, h in zip(engine_rows, hf_rows))
    assert len(engine_rows) == len(hf_rows) == 24 and same >= 22
    assert abs(engine["eval/accuracy"] - hf["eval/accuracy"]) <= (24 - same) / 24


@pytest.mark.parametrize("lora", [[], LORA, ["model=tiny_dense", *TINY["tiny_dense"], *LORA_ADAPTER]],
                         ids=["full", "lora", "lora_adapter"])
def test_every_rl_step_samples_with_that_steps_weights(lora, compose, rl_overrides):
    """A run: each rollout's engine log-probs are the trainer's to float32 rounding (mismatch/*), so each step's
    sync reached the engine after the previous step's updates (a fused AdamW step leaves no trace in the
    parameters' version counters; the sync cannot rely on them). With LoRA (a merged sync, or the adapters alone)
    the adapters move, and the engine follows them: mismatch/kl < 1e-8 at every step."""
    dense = lora[:1] == ["model=tiny_dense"]
    model = [o for o in rl_overrides if not o.startswith("model.")] if dense else rl_overrides
    run, module, _ = build(compose(model + VLLM + lora + ["train.steps=3", "train.eval_every=3"]))
    run.trainer.fit(module)
    rows = [row for row in module.history if "mismatch/kl" in row]
    assert len(rows) == 3 and all(row["mismatch/seq_log_ratio_abs"] <= ROUNDING for row in rows)
    assert all(row["mismatch/kl"] < 1e-8 for row in rows)
    assert module.engine.llm is None  # the module's teardown closed it
    if lora:
        adapters = [p for name, p in module.model.named_parameters() if "lora_B" in name]
        assert adapters and all(p.abs().max() > 0 for p in adapters)  # B starts at 0: the merged delta grew


def test_a_lagged_run_samples_each_step_with_the_weights_k_steps_back(compose, rl_overrides, updated_batches):
    """rollout.max_staleness=1 (async_mode=lagged) on vLLM: step 0's rollout comes from the starting weights, and so
    does step 1's, though the trainer has taken a step: its engine log-probs are the starting weights' (to float32
    rounding across implementations), not the trained weights', and they are π_old (bypass)."""
    run, module, _ = build(compose(rl_overrides + VLLM + ["train.steps=2", "train.eval_every=0",
                                                          "rollout.max_staleness=1",
                                                          "rollout.logprobs_from_generation=true"]))
    starting = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    run.trainer.fit(module)
    assert [row["off_policy/staleness_max"] for row in module.history] == [0, 1]
    batch = updated_batches[1]
    current = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    logps = []
    for weights in (starting, current):  # the starting weights' log-probs of step 1's tokens, then the trainer's
        module.model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            logps.append(token_logprobs(module.model, batch.input_ids, batch.attention_mask, batch.completion_len,
                                        module.rollout_cfg.temperature)[0])
    mask = batch.policy_mask.bool()
    assert (batch.rollout_logp - logps[0])[mask].abs().max() <= ROUNDING
    assert (batch.rollout_logp - logps[1])[mask].abs().max() > 100 * ROUNDING
    assert torch.equal(batch.old_logp, batch.rollout_logp)


@pytest.mark.slow
@pytest.mark.long
def test_a_run_on_vllm_learns_the_default_task_as_one_on_transformers(cold_start_cache, tmp_path):
    """The default experiment for 150 RL steps on seeds 0-2 with each backend, in one multirun process (each job
    starts and closes its own engine): every vLLM run gains, and the backends' mean gains differ by less than
    their seed noise (two standard errors of the difference)."""
    result = subprocess.run(
        [sys.executable, "-m", "gspo_lab.train", "-m", "rollout.backend=hf,vllm", "seed=0,1,2", "train.steps=150",
         "train.eval_every=150", "callbacks.progress.refresh_rate=0", f"paths.cache_dir={cold_start_cache}",
         f"hydra.sweep.dir={tmp_path}", "hydra/launcher=basic"],
        cwd=tmp_path, env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True, timeout=3600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    gains = {"hf": [], "vllm": []}
    for summary in sorted(tmp_path.rglob("summary.json")):  # the cache dir's slashes nest the job dirs
        values = json.loads(summary.read_text())
        backend = OmegaConf.load(summary.parent / "config.yaml").rollout.backend
        gains[backend].append(values["eval/accuracy_after"] - values["eval/accuracy_before"])
    assert len(gains["hf"]) == len(gains["vllm"]) == 3 and min(gains["vllm"]) > 0
    hf, vllm = torch.tensor(gains["hf"]), torch.tensor(gains["vllm"])
    noise = (hf.var() / 3 + vllm.var() / 3).sqrt()
    assert (vllm.mean() - hf.mean()).abs() <= 2 * noise + 0.01, gains


def test_a_model_built_from_config_and_never_saved_is_served(compose, tiny, tmp_path):
    """Without a cold start the model was never saved, so its config names no architecture, and vLLM guessed a
    pooling runner (which wants a tokenizer: ValueError at start)."""
    _, module, _ = build(compose(tiny + VLLM + ["sft.enabled=false", f"paths.output_dir={tmp_path}"]))
    assert not module.model.config.architectures
    try:
        module.engine.sync()
        assert engine_gap(module, torch.tensor([1, 2, 3, 4])) <= ROUNDING
    finally:
        module.close()


def test_prompts_too_many_to_prefill_in_one_step_are_served(compose, tmp_path):
    """experiment=bench_paper's 128 rows of about 115 prompt tokens exceed one scheduler step, so vLLM chunked
    their prefill and rewound a seeded CPU generator to discard a partial row's token, which CPU generators cannot
    (RuntimeError: CPU Generator does not use offset); on CPU each prompt is now prefilled whole."""
    run, module, _ = build(compose(VLLM + ["experiment=bench_paper", "train.steps=1",
                                           "model.config.num_hidden_layers=2", f"paths.output_dir={tmp_path}",
                                           "callbacks.progress.refresh_rate=0"]))
    run.trainer.fit(module)
    assert module.history[0]["rollout/completions"] == 128 and module.history[0]["mismatch/kl"] < 1e-9


def test_a_bfloat16_engine_syncs_without_a_warning_per_parameter(compose, tiny, tmp_path):
    """rollout.vllm.dtype=bfloat16 under a float32 trainer: vLLM warned, at every sync, for every parameter, that
    a float32 weight went into a bfloat16 parameter (2,754 lines in a 25-step small_moe run), which is the cast the
    run asked for. The sync is quiet, the same reload without the filter is not (the control: vLLM configures its
    loggers when it starts, so the capture is attached after), and the engine does run in bfloat16."""
    records = []
    capture = logging.Handler()
    capture.emit = records.append
    loads = logging.getLogger("vllm.model_executor.models.utils")
    _, module, _ = build(compose(tiny + VLLM + ["rollout.vllm.dtype=bfloat16", "sft.enabled=false",
                                                f"paths.output_dir={tmp_path}"]))
    try:
        module.engine.sync()  # starts vLLM
        loads.addHandler(capture)
        module.engine.sync()
        quiet = [r.getMessage() for r in records]
        for found in [f for f in loads.filters if isinstance(f, NarrowingLoadFilter)]:
            loads.removeFilter(found)
        module.engine.llm.collective_rpc(reload_in_worker, args=(checkpoint_weights(module.model),))
        assert engine_gap(module, torch.tensor([1, 2, 3, 4])) > 100 * ROUNDING  # bfloat16 has 8 bits of mantissa
    finally:
        module.close()
        loads.removeHandler(capture)
    assert not [m for m in quiet if "Attempted to load weight" in m]
    assert len([r for r in records if "Attempted to load weight" in r.getMessage()]) >= 5  # one per parameter


@pytest.mark.parametrize("model", sorted(BUFFERS_SYNCED_FAMILIES))
def test_a_routers_selection_bias_reaches_the_engine_at_every_sync(model, compose, tiny, tmp_path):
    """transformers keeps a DeepSeek-style router's e_score_correction_bias as a persistent buffer, and a sync of
    parameters only left vLLM's engine routing with its dummy values (float32: mismatch/kl 3.5e-6 on tiny_glm4_moe
    against 3.6e-14 on tiny_moe). After the bias itself changes, the engine is stale until the next sync, and then
    its log-probs are the trainer's again."""
    overrides = [o for o in tiny if not o.startswith("model.")] + [f"model={model}", "model.config.head_dim=32",
                                                                    "model.config.num_hidden_layers=2"]
    _, module, _ = build(compose(overrides + VLLM + ["sft.enabled=false", f"paths.output_dir={tmp_path}"]))
    buffers = persistent_buffer_names(module.model)
    seeds = torch.tensor([1, 2, 3, 4])
    assert buffers and all(name.endswith("e_score_correction_bias") for name in buffers)
    assert type(module.model).__name__ == BUFFERS_SYNCED_FAMILIES[model]
    assert set(BUFFERS_SYNCED_FAMILIES.values()) == BUFFERS_SYNCED  # every architecture served has its test
    try:
        module.engine.sync()
        assert engine_gap(module, seeds) <= ROUNDING
        with torch.no_grad():  # a bias of the logits' size moves the top-k of most tokens
            for name in buffers:
                module.model.get_buffer(name).normal_(0, 4)
        assert engine_gap(module, seeds) > 100 * ROUNDING
        module.engine.sync()
        assert engine_gap(module, seeds) <= ROUNDING
    finally:
        module.close()


@pytest.mark.parametrize("model", ["tiny_minimax_m2", "tiny_deepseek_v3"])
def test_a_family_whose_buffers_no_test_has_synced_is_refused(model, compose, tmp_path):
    with pytest.raises(ConfigError, match=r"keeps model\.layers\.0\.mlp\.(gate\.)?e_score_correction_bias as a "
                                          r"persistent buffer, and no test has shown"):
        plan(compose(VLLM + [f"model={model}", "model.config.head_dim=32", f"paths.output_dir={tmp_path}"]))


def test_the_engine_runs_with_autocast_off_whatever_the_trainers_precision(compose, tiny, tmp_path):
    """trainer.precision=bf16-mixed wraps the RL step in torch.autocast(bfloat16): vLLM's start, sync, sampling and
    evaluation run inside it, and a float32 engine would multiply in bfloat16. Every forward of vLLM's model sees
    autocast off, and the engine's log-probs are the float32 trainer's to rounding (bfloat16 would miss by 1e-3)."""
    _, module, _ = build(compose(tiny + VLLM + ["sft.enabled=false", "trainer.precision=bf16-mixed",
                                                f"paths.output_dir={tmp_path}"]))
    seen = []

    def record(worker) -> None:
        worker.model_runner.model.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))

    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module.engine.sync()  # starts the engine
            module.engine.llm.collective_rpc(record)
            module.engine.sync()
            module.engine.sync()
            completions = module.engine.generate(module.tokenizer, PROMPTS, Sampling(4, greedy=True)).completions
        assert completions.completion_mask.sum() > 0
        assert engine_gap(module, torch.tensor([1, 2, 3, 4])) <= ROUNDING
    finally:
        module.close()
    assert len(seen) >= 2 and not any(seen)


def test_a_failed_prefix_cache_reset_stops_the_sync(compose, tiny, tmp_path):
    """A reset that fails leaves the old weights' keys and values in the prefix cache for the next rollout."""
    _, module, _ = build(compose(tiny + VLLM + ["sft.enabled=false", f"paths.output_dir={tmp_path}"]))
    try:
        module.engine.sync()
        module.engine.llm.reset_prefix_cache = lambda: False
        with pytest.raises(RuntimeError, match="did not reset its prefix cache after a weight sync"):
            module.engine.sync()
    finally:
        module.close()


def test_each_engine_of_a_multirun_gets_its_own_kv_cache(compose, tiny, tmp_path, monkeypatch):
    """rollout.vllm.cpu_kv_cache_gb went to VLLM_CPU_KVCACHE_SPACE with setdefault, so a multirun's later jobs kept
    the first job's size. Two engines in one process, 1 then 2 GiB: each gets its own."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    sizes = []
    for gb in (1, 2):
        _, module, _ = build(compose(tiny + VLLM + ["sft.enabled=false", f"rollout.vllm.cpu_kv_cache_gb={gb}",
                                                    f"paths.output_dir={tmp_path / str(gb)}"]))
        try:
            module.engine.sync()
            sizes.append(module.engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes)
        finally:
            module.close()
    assert sizes == [2**30, 2 * 2**30]
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ


@pytest.mark.parametrize("overrides, message", [
    (["rollout.temperature=0.005"], r"rollout.temperature=0.005 with rollout.backend=vllm: vLLM samples at a "
                                    r"temperature of at least 0.01"),
    (["eval.temperature=0.001", "eval.n=2"], r"eval.temperature=0.001 with rollout.backend=vllm"),
    (["+trainer.num_nodes=2"], r"trainer.num_nodes=2 with rollout.backend=vllm on CPU"),
])
def test_what_vllm_would_change_silently_is_refused(overrides, message, compose, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan(compose(VLLM + overrides + [f"paths.output_dir={tmp_path}"]))


def test_an_evaluation_on_the_trainer_samples_at_any_temperature(compose, tmp_path):
    plan(compose(VLLM + ["eval.temperature=0.001", "eval.n=2", "eval.engine=trainer", f"paths.output_dir={tmp_path}"]))


@pytest.mark.parametrize("overrides, warned", [(["train.lm_head_fp32=true", "rollout.vllm.dtype=bfloat16"], True),
                                               (["train.lm_head_fp32=true"], False),  # a float32 engine
                                               (["rollout.vllm.dtype=bfloat16"], False)])
def test_a_float32_head_the_engine_does_not_have_is_told(overrides, warned, compose, tmp_path, caplog):
    plan(compose(VLLM + overrides + [f"paths.output_dir={tmp_path}"]))
    assert ("computes its own in rollout.vllm.dtype=bfloat16" in caplog.text) is warned


def test_a_multi_turn_run_continues_from_token_ids_on_the_engine(compose, tool_rl, tmp_path, updated_batches):
    """task=calculator with tools (tests/conftest.py's tool_rl) on vLLM: trajectories call tools, each turn
    continues from the token ids so far, the engine's log-probs cover the model's tokens (the trainer's, to float32
    rounding) and are 0 on the tools', which are attended and out of the loss."""
    run, module, _ = build(compose(tool_rl + VLLM + [f"paths.output_dir={tmp_path / 'run'}", "train.steps=1"]))
    run.trainer.fit(module)
    first, batch = module.history[0], updated_batches[0]
    assert first["tools/call_frequency"] > 0 and first["turns/mean"] > 1
    attended = batch.attention_mask[:, -batch.completion_len :].bool()
    tools = attended & (batch.turns == 0)
    assert tools.any() and batch.rollout_logp[tools].eq(0).all() and not batch.loss_mask.bool()[tools].any()
    model_tokens = batch.loss_mask.bool()  # π_old: the trainer's forward before the update, over the whole context
    assert (batch.rollout_logp - batch.old_logp)[model_tokens].abs().max().item() <= ROUNDING


def test_the_engine_scores_its_own_samples_as_it_sampled_them(compose, rl_overrides):
    """rollout.rescore=vllm's scores (prompt log-probs, one prefill) of the engine's samples are its sampling
    log-probs and the trainer's, to float32 rounding across implementations."""
    _, module, _ = build(compose(rl_overrides + VLLM))
    module.engine.sync()
    completions = module.engine.generate(module.tokenizer, PROMPTS, rollout_sampling(module),
                                         torch.arange(len(PROMPTS))).completions
    scores = module.engine.score(module.tokenizer, completions, 1.0)
    input_ids = torch.cat([completions.prompt_ids, completions.completion_ids], 1)
    attention = torch.cat([completions.prompt_mask, completions.completion_mask], 1)
    with torch.no_grad():
        trainer = token_logprobs(module.model, input_ids, attention, completions.completion_ids.shape[1], 1.0)[0]
    module.close()
    mask = completions.completion_mask.bool()
    assert (scores - completions.logprobs)[mask].abs().max() <= ROUNDING
    assert (scores - trainer)[mask].abs().max() <= ROUNDING
    assert torch.equal(scores[~mask], torch.zeros_like(scores[~mask]))


@pytest.mark.parametrize("engines", [["rollout.backend=hf", "rollout.engine.precision=bf16", "rollout.rescore=vllm",
                                      "rollout.vllm.dtype=float32"],
                                     ["rollout.backend=vllm", "rollout.vllm.dtype=bfloat16", "rollout.rescore=hf"]])
def test_pi_old_comes_from_the_engine_that_rescores_the_samples(engines, compose, rl_overrides, updated_batches):
    """A bfloat16 engine samples (the simulated one, or vLLM) and a float32 one rescores (vLLM, or transformers on
    the trainer's weights): π_old (logprobs_from_generation=true) is the trainer's to float32 rounding, and the
    rescoring moved the bfloat16 log-probs by more than rounding."""
    run, module, _ = build(compose(rl_overrides + engines + ["train.steps=1", "train.eval_every=0",
                                                             "rollout.logprobs_from_generation=true"]))
    starting = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    run.trainer.fit(module)
    batch = updated_batches[0]
    module.model.load_state_dict(starting, strict=False)
    with torch.no_grad():
        trainer = token_logprobs(module.model, batch.input_ids, batch.attention_mask, batch.completion_len, 1.0)[0]
    mask = batch.loss_mask.bool()
    assert (batch.old_logp - trainer)[mask].abs().max() <= ROUNDING
    assert module.history[0]["rescore/logp_abs_diff"] > 100 * ROUNDING


# three router families, as vLLM's CPU router computes them: softmax top-k (Qwen3-MoE), sigmoid steered by a
# correction bias (GLM-4.5, one group), and grouped top-k (GLM-4.5 with 2 groups, 1 kept; a dense first layer, so
# the engine's MoE layers are renumbered to the trainer's)
R3_FAMILIES = {
    "softmax_topk": ["model=tiny_moe", "model.config.num_hidden_layers=2", "model.config.hidden_size=64",
                     "model.config.moe_intermediate_size=32"],
    "sigmoid_bias": ["model=tiny_glm4_moe", "model.config.head_dim=32", "model.config.num_hidden_layers=2",
                     "model.config.n_group=1", "model.config.topk_group=1"],
    "grouped": ["model=tiny_glm4_moe", "model.config.head_dim=32", "model.config.num_hidden_layers=3",
                "model.config.first_k_dense_replace=1"],
}
# the softmax family with LoRA on its router's gate and its experts, whose engine gets them merged
R3_FAMILIES["softmax_topk_lora"] = R3_FAMILIES["softmax_topk"] + LORA


@pytest.mark.parametrize("family", sorted(R3_FAMILIES))
def test_the_engines_experts_are_the_trainers_and_replaying_them_changes_no_logprob(family, compose, tiny, tmp_path,
                                                                                    monkeypatch):
    """routing.replay=r3 on vLLM: on a float32 engine the experts it captured for every prompt and completion token
    (prompts the prefix cache served, whose experts come from the call that computed them, included) are the
    trainer's own top-k, in each family; replaying them in a trainer forward leaves every log-prob as it was."""
    from gspo_lab.routing.hooks import record_routing, replay_routing

    filled = []
    fill = Captured.fill_prefix
    monkeypatch.setattr(Captured, "fill_prefix", lambda self, *args: filled.append(args[2]) or fill(self, *args))

    overrides = [o for o in tiny if not o.startswith("model.")] + R3_FAMILIES[family]
    _, module, _ = build(compose(overrides + VLLM + ["routing.replay=r3", "sft.enabled=false",
                                                     f"paths.output_dir={tmp_path}"]))
    try:
        with torch.no_grad():  # a selection bias of the logits' size: the sigmoid families route by it
            for name in persistent_buffer_names(module.model):
                module.model.get_buffer(name).normal_(0, 1)
            for name, parameter in module.model.named_parameters():  # adapters as if trained (B starts at 0)
                if "lora_B" in name:
                    parameter.normal_(0, 0.5)
        module.engine.sync()
        sampling = rollout_sampling(module)
        long = [p[:-1] + "+1" * 80 + "=" for p in PROMPTS]  # over a block of the CPU cache (128 tokens): cached
        module.engine.generate(module.tokenizer, long, sampling, torch.arange(4), routing=module.routing)
        prompts = [p for p in long for _ in range(2)]  # each prompt again, twice: from the prefix cache
        generated = module.engine.generate(module.tokenizer, prompts, sampling, torch.arange(4, 12),
                                           routing=module.routing)
    finally:
        module.close()
    completions, engine = generated.completions, generated.routing_trace
    input_ids = torch.cat([completions.prompt_ids, completions.completion_ids], 1)
    mask = torch.cat([completions.prompt_mask, completions.completion_mask], 1)
    with torch.no_grad(), record_routing(module.model, completions.prompt_ids.shape[1]) as own:
        free, _ = token_logprobs(module.model, input_ids, mask, completions.completion_ids.shape[1], 1.0)
    with torch.no_grad(), replay_routing(module.model, engine, mask):
        replayed, _ = token_logprobs(module.model, input_ids, mask, completions.completion_ids.shape[1], 1.0)
    last = mask.cumsum(1) == mask.sum(1, keepdim=True)  # each row's last token: never fed back to the engine
    expected = mask.bool() & ~last
    assert torch.equal(engine.recorded, expected)
    assert engine.num_layers == own.num_layers == 2  # the grouped family's dense first layer has no router
    assert len(filled) == len(prompts) and min(filled) > 1  # the cached prompts' experts came from the first call
    same = engine.indices.sort(-1).values == own.indices.sort(-1).values  # [layers, B, L, k]
    assert same.all(-1).all(0)[expected].all()
    torch.testing.assert_close(replayed, free, rtol=0, atol=ROUNDING)


def test_an_r3_run_replays_the_engines_experts_over_whole_trajectories(compose, tool_rl, tmp_path):
    """GRPO-R3 on vLLM with tools (a float32 engine): every training forward replays the experts the engine chose
    for the prompt, each turn and each tool result (a later turn's prompt served from the prefix cache takes the
    experts of the turn that computed it); on the first mini-batch, weights as at generation, replay overrides no
    choice of the trainer's, and every token ratio is 1."""
    run, module, _ = build(compose(tool_rl + VLLM + ["algorithm=grpo_r3", f"paths.output_dir={tmp_path / 'run'}",
                                                     "train.minibatches=1", "train.steps=1"]))
    run.trainer.fit(module)
    first = module.history[0]
    assert first["turns/mean"] > 1 and first["routing/rollout_disagreement"] == 0
    assert first["routing/override_frac"] == 0  # logged only where replay ran
    assert abs(first["ratio/token/max"] - 1) <= 1e-5 and abs(first["ratio/token/min"] - 1) <= 1e-5


def test_on_a_bf16_engine_r3_takes_the_routing_out_of_the_mismatch(compose, rl_overrides):
    """A bfloat16 engine routes some tokens to other experts than the float32 trainer (routing/rollout_disagreement
    > 0). mismatch/kl measures the trainer's own routing (no replay) against the engine: the same under r2 and r3.
    What the step trains on differs: under r2 π_old comes from a forward that routes on its own, and its mismatch
    with the engine (mismatch/pi_old_kl) holds those flips; under r3 that forward replays the engine's experts, and
    what is left is the engine's rounding alone."""
    rows = {}
    for algorithm in ("grpo_rr", "grpo_r3"):
        run, module, _ = build(compose(rl_overrides + VLLM + [
            f"algorithm={algorithm}", "rollout.vllm.dtype=bfloat16", "train.steps=1", "train.eval_every=0",
            "rollout.prompts_per_step=8", "rollout.max_new_tokens=24", "routing.diagnostics_rows=32"]))
        run.trainer.fit(module)
        rows[algorithm] = module.history[0]
    r2, r3 = rows["grpo_rr"], rows["grpo_r3"]
    assert r2["completion/len_mean"] == r3["completion/len_mean"]  # the same rollout
    assert r2["routing/rollout_disagreement"] == r3["routing/rollout_disagreement"] > 0
    assert r2["mismatch/kl"] == r3["mismatch/kl"] == pytest.approx(r2["mismatch/pi_old_kl"], rel=0.5)
    assert r3["mismatch/pi_old_kl"] < r2["mismatch/pi_old_kl"]
