"""Every study in conf/experiment runs one tiny step per job through Hydra multirun, a failed job does not
stop a sweep, gspo-report turns a multirun dir into its tables and figures, and hparams_search=gspo_optuna
runs a seeded Optuna search whose trials gspo-report reads."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.report.study import FIGURES, main as report_main

# recipe_* (a user's model and data on GPUs) run on tiny stand-ins in tests/test_recipes.py
EXPERIMENTS = {p.stem: OmegaConf.load(p) for p in sorted((Path(CONFIG_DIR) / "experiment").glob("*.yaml"))
               if not p.stem.startswith("recipe_")}
STUDIES = sorted(name for name, cfg in EXPERIMENTS.items() if OmegaConf.select(cfg, "hydra.sweeper.params"))
SINGLE_RUNS = sorted(set(EXPERIMENTS) - set(STUDIES))
TINY = ["model.config.hidden_size=64", "model.config.moe_intermediate_size=32", "train.steps=1",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "task.eval_size=8",
        "callbacks.progress.refresh_rate=0"]


def gspo_train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, "-m", "gspo_lab.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


VLLM_STUDIES = ("real_engine", "engine_r3")  # rollouts from vLLM: run under make test-vllm


def finished_runs(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in sweep.glob("*/summary.json"))


def test_every_experiment_is_tested():
    assert STUDIES == ["clip_lr", "clip_range", "engine_r3", "entropy", "expert_volatility", "group_size", "length_norm",
                       "length_norm_long",
                       "multi_turn_calculator", "multi_turn_guess_number", "objective_zoo", "objective_zoo_long",
                       "off_policy", "overoptimization", "paper_main", "partial_rollouts", "precision", "real_engine",
                       "routing_replay", "stability", "staleness"]
    assert SINGLE_RUNS == ["bench_anchor", "bench_gpu", "bench_paper", "bench_varlen", "bench_vocab"]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", SINGLE_RUNS)
def test_single_run_experiment_runs_one_tiny_step(experiment, tmp_path):
    small = ["model.config.hidden_size=64", "model.config.head_dim=16", "rollout.max_new_tokens=8"]
    if experiment != "bench_vocab":  # dense
        small.append("model.config.moe_intermediate_size=32")  # bench_gpu's 334M model would take minutes here
    result = gspo_train([f"experiment={experiment}", "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}",
                         "model.config.num_hidden_layers=1", "callbacks.progress.refresh_rate=0", *small], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.csv") as file:
        assert len(file.read().splitlines()) == 2  # header and the one step (no evaluation row)


@pytest.mark.slow
@pytest.mark.parametrize("study", [pytest.param(s, marks=pytest.mark.vllm) if s in VLLM_STUDIES else s
                                   for s in STUDIES])
def test_study_runs_its_grid_for_one_tiny_step(study, tmp_path):
    if study in VLLM_STUDIES:  # rollouts from vLLM: make test-vllm runs it
        pytest.importorskip("vllm")
    swept = EXPERIMENTS[study].hydra.sweeper.params
    dense = "override /model: tiny_dense" in OmegaConf.to_yaml(EXPERIMENTS[study].get("defaults", []))
    tiny = [o for o in TINY + ["model.config.num_hidden_layers=1"] if o.split("=")[0] not in swept
            and not (dense and o.startswith("model.config.moe_"))]
    if study == "overoptimization":  # its proxy is a reward model made by a script (7 minutes): a tiny one here
        from tests.rewards.graders import save_grader

        tiny.append(f"reward.functions.0.path={save_grader(tmp_path / 'reward_model')}")
    if study == "partial_rollouts":  # its partial arm (the sweep's default is the synchronous one)
        tiny += ["rollout.max_staleness=2", "rollout.segment_tokens=2", "train.steps=3"]
    result = gspo_train(["-m", f"experiment={study}", "seed=0", "sft.enabled=false", "hydra/launcher=basic",
                         f"hydra.sweep.dir={tmp_path / 'sweep'}", f"paths.cache_dir={tmp_path / 'cache'}", *tiny],
                        tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = finished_runs(tmp_path / "sweep")
    expected = {"paper_main": 5, "clip_range": 6, "clip_lr": 12, "group_size": 4, "length_norm": 2, "length_norm_long": 2,
                "objective_zoo": 16, "objective_zoo_long": 16, "routing_replay": 6, "expert_volatility": 8,
                "off_policy": 4, "stability": 6, "precision": 4, "real_engine": 4, "engine_r3": 3, "entropy": 2,
                "multi_turn_calculator": 5, "multi_turn_guess_number": 5, "staleness": 20,
                "overoptimization": 6, "partial_rollouts": 4}[study]
    assert len(runs) == expected
    assert all((run / "metrics.csv").is_file() for run in runs)


def test_a_sweep_of_two_jobs_runs_both_and_reports(tmp_path):
    """The smoke test of multirun in `make test`: two algorithms x two seeds in two parallel joblib jobs, then
    gspo-report on the sweep: each setting's row has its two seeds and a bootstrap interval, the evaluation
    metric asked for (--metric) too, and each setting a sample table and its evaluation set a curve."""
    sweep = tmp_path / "sweep"
    result = gspo_train(["-m", "algorithm=gspo,grpo", "seed=0,1", "sft.enabled=false", "hydra/launcher=joblib",
                         f"hydra.sweep.dir={sweep}", "model.config.num_hidden_layers=1", "train.eval_every=1",
                         "eval.n=2", "eval.k=[1,2]", "eval.samples=2", *TINY], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = finished_runs(sweep)
    assert [run.name.split(",")[0] for run in runs] == ["0_algorithm=gspo", "1_algorithm=gspo", "2_algorithm=grpo",
                                                        "3_algorithm=grpo"]
    report_main([str(sweep), "--baseline", "algorithm=gspo", "--metric", "eval/heldout/pass@2"])
    text = (sweep / "report.md").read_text()
    assert re.search(r"^\| algorithm=grpo \| 2 \| [012] \| [012] \| \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \|", text, re.MULTILINE)
    header = next(line for line in text.splitlines() if line.startswith("| setting | seeds | collapsed"))
    assert header.endswith("| clip/frac | eval/heldout/pass@2 |")
    assert re.search(r"^\| algorithm=gspo \|.* \| \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \|$", text, re.MULTILINE)
    samples = text.split("## Samples: algorithm=gspo (seed 0)")[1].split("##")[0]
    assert "| set | prompt | reference | step | greedy | samples |" in samples
    assert re.search(r"^\| heldout \| .* \| 1 \| [✓✗] .* \| [✓✗] .* · [✓✗] ", samples, re.MULTILINE)  # the last step
    assert (sweep / "eval_heldout.png").is_file()
    assert re.search(r"^\| algorithm=grpo \| 2 \| -?\d\.\d{3} \[", text.split("## Paired")[1], re.MULTILINE)
    assert (sweep / "report.html").stat().st_size > 0 and (sweep / "statistics.csv").is_file()


@pytest.mark.slow
def test_joblib_sweep_survives_a_failed_job_and_reports(tmp_path, cold_start_cache):
    sweep = tmp_path / "sweep"
    result = gspo_train(["-m", "algorithm=gspo,grpo", "seed=0,1", "rollout.temperature=1.0,-1.0",
                         "hydra/launcher=joblib", f"hydra.sweep.dir={sweep}", f"paths.cache_dir={cold_start_cache}",
                         "model.config.num_hidden_layers=1", "sft.steps=60", "sft.eval_every=60", "sft.eval_size=16",
                         "sft.target_accuracy=1.0", "sft.batch_size=64", "task.format_weight=0.5",
                         *TINY, "train.steps=3"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(finished_runs(sweep)) == 4  # temperature 1.0: gspo, grpo x seeds 0, 1
    failed = sorted(sweep.glob("*/failed.txt"))
    assert len(failed) == 4 and "rollout.temperature=-1.0 is invalid" in failed[0].read_text()
    report_main([str(sweep), "--baseline", "algorithm=gspo rollout.temperature=1.0"])
    for name in ["report.md", *FIGURES]:
        assert (sweep / name).stat().st_size > 0, name
    text = (sweep / "report.md").read_text()
    assert "| algorithm=grpo rollout.temperature=1.0 | 2 |" in text  # two seeds, each setting's row
    assert "Paired differences against `algorithm=gspo rollout.temperature=1.0`" in text
    assert "failed (see failed.txt)" in text  # the failed jobs are named, not silently dropped


def test_report_on_an_empty_dir_fails_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no runs under .*: expected run dirs holding run_info.json"):
        report_main([str(tmp_path)])
    with pytest.raises(SystemExit, match="is not a directory"):
        report_main([str(tmp_path / "missing")])


def test_bench_gpu_is_a_few_hundred_million_parameter_moe_in_bf16(compose):
    cfg = compose(["experiment=bench_gpu"])
    with torch.device("meta"):  # shapes only: nothing is allocated
        model, _ = instantiate(cfg.model).load()
    parameters = sum(p.numel() for p in model.parameters())
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and 300e6 < parameters < 400e6  # 334M
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config.num_experts_per_tok == 4
    assert cfg.rollout.prompts_per_step * cfg.rollout.group_size == 256 and cfg.rollout.max_new_tokens == 128


def test_the_search_config_is_a_seeded_maximising_optuna_sweep():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=["hparams_search=gspo_optuna"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.gspo_lab_optuna.ResumableOptunaSweeper"
    assert cfg.hydra.mode == RunMode.MULTIRUN  # `gspo-train hparams_search=gspo_optuna` needs no -m
    assert sweeper.direction == "maximize" and sweeper.n_trials == 20
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed == 1234
    assert dict(sweeper.params) == {"train.lr": "tag(log, interval(1e-5, 3e-4))",
                                    "clip_scale": "tag(log, interval(0.25, 4.0))"}


def test_a_three_trial_search_of_one_step_writes_its_results_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    # two random start-up trials, so the third is proposed by TPE's model (optuna 2.10 on numpy 2)
    result = gspo_train(["hparams_search=gspo_optuna", "hydra.sweeper.n_trials=3",
                         "hydra.sweeper.sampler.n_startup_trials=2", "sft.enabled=false",
                         f"hydra.sweep.dir={sweep}", "model.config.num_hidden_layers=1", *TINY], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = finished_runs(sweep)
    assert len(runs) == 3
    trials = [yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) for run in runs]
    learning_rates = [float(next(o for o in t if o.startswith("train.lr="))[9:]) for t in trials]
    assert len(set(learning_rates)) == 3 and all(1e-5 <= lr <= 3e-4 for lr in learning_rates)
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"train.lr", "clip_scale"}
    accuracies = [json.loads((run / "summary.json").read_text())["eval/accuracy_after"] for run in runs]
    assert results["best_value"] == max(accuracies)  # what main returned is what the sweeper maximised

    report_main([str(sweep)])
    text = (sweep / "report.md").read_text()
    assert f"Optuna search in {sweep}: best trial `train.lr=" in text
    settings = text.split("## Settings")[1].split("##")[0]
    assert sum(line.startswith("| clip_scale=") and " | 1 | " in line for line in settings.splitlines()) == 3
