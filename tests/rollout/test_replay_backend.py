"""rollout.backend=replay, the example of a backend in one file (docs/how-to/extend.md): a real run trains on the
completions recorded for its prompts, scores them as recorded, and moves the policy toward the correct ones;
bad settings are refused before anything trains."""

import json

import pytest

from gspo_lab.rollout.backend import Sampling, backend_class
from gspo_lab.rollout.replay import ReplayBackend
from gspo_lab.train import ConfigError, build, plan

STEPS = 2


def record(compose, overrides: list[str], path) -> dict[str, tuple[str, str]]:
    """A file holding, for every prompt the run draws, two correct completions and two wrong ones (the answer
    plus one); returns each prompt's (correct, wrong) pair."""
    _, module, _ = build(compose(overrides))
    pairs = {}
    for step in range(STEPS):
        examples = module.collector.rows.prompts.for_step(step)
        for text, example in zip(module.render.texts(examples), examples):
            pairs[text] = (str(example.answer), str(int(example.answer) + 1))
    module.close()
    path.write_text("".join(json.dumps({"prompt": p, "completions": [c, w, c, w]}) + "\n"
                            for p, (c, w) in pairs.items()))
    return pairs


def completion_logp(module, prompt: str, completion: str) -> float:
    """The policy's mean log-prob of `completion`'s tokens (and its EOS) after `prompt`."""
    backend = ReplayBackend(module.model, module.rollout_cfg)
    backend.recorded = {prompt: [completion]}
    out = backend.generate(module.tokenizer, [prompt], Sampling(8, add_special_tokens=module.render.add_special_tokens))
    return (out.completions.logprobs.sum() / out.completions.completion_mask.sum()).item()


def test_a_run_trains_on_the_recorded_completions(compose, fast_rl, tmp_path):
    """Groups of 2 correct and 2 wrong completions: reward/mean is 0.5 and reward/std 0.5 on every step (the
    checker's 1 and 0; no format reward), the engine's log-probs are the trainer's (mismatch/kl 0 to rounding),
    and the updates raise the correct completions' log-probs above where they started, relative to the wrong."""
    overrides = fast_rl + ["task.format_weight=0.0", f"train.steps={STEPS}", "train.eval_every=0",
                           "rollout.max_new_tokens=8", f"paths.output_dir={tmp_path / 'run'}"]
    path = tmp_path / "recorded.jsonl"
    pairs = record(compose, overrides, path)
    replay = overrides + ["rollout=replay", f"rollout.options.path={path}"]
    run, module, _ = build(compose(replay))

    def mean_gap() -> float:  # correct minus wrong, over the prompts
        gaps = [completion_logp(module, p, c) - completion_logp(module, p, w) for p, (c, w) in pairs.items()]
        return sum(gaps) / len(gaps)

    before = mean_gap()
    run.trainer.fit(module)
    rows = [row for row in module.history if "reward/mean" in row]
    assert len(rows) == STEPS
    for row in rows:
        assert row["reward/mean"] == 0.5 and row["reward/std"] == 0.5
        assert row["mismatch/kl"] < 1e-10
    assert mean_gap() > before + 0.01


@pytest.mark.parametrize("extra, match", [
    ([], r"rollout.backend=replay needs rollout.options.path"),
    (["rollout.options.path=/nonexistent.jsonl"], r"rollout.options.path='/nonexistent.jsonl': no such file"),
    (["+rollout.options.paths=x"], r"rollout.options.paths is not a setting of rollout.backend=replay"),
])
def test_bad_replay_settings_are_refused_at_plan_time(extra, match, compose, tmp_path):
    with pytest.raises(ConfigError, match=match):
        plan(compose(["rollout=replay", *extra, f"paths.output_dir={tmp_path}"]))


def test_a_malformed_recording_names_its_file_and_line(compose, tmp_path):
    path = tmp_path / "recorded.jsonl"
    path.write_text('{"prompt": "1+1=", "completions": ["2"]}\n{"prompt": "2+2=", "completions": []}\n')
    with pytest.raises(ConfigError, match=r"recorded.jsonl:2: must be"):
        plan(compose(["rollout=replay", f"rollout.options.path={path}", f"paths.output_dir={tmp_path}"]))


def test_a_backend_of_your_own_package_is_named_by_its_path(compose, tmp_path):
    """rollout.backend takes a registry name or "package.module:Class"; an unimportable one is refused by name."""
    assert backend_class("gspo_lab.rollout.replay:ReplayBackend") is backend_class("replay") is ReplayBackend
    with pytest.raises(ConfigError, match=r"rollout.backend='my_pkg.backends:Mine': cannot import Mine from my_pkg"):
        plan(compose(["rollout.backend=my_pkg.backends:Mine", f"paths.output_dir={tmp_path}"]))
