"""reward=judge (gspo_lab.rewards.judge): a causal LM grading with a rubric, on a tiny judge saved here: the verdict
odds against a forward of each grading prompt alone, strict parsing with counted failures, the refusals, a run; on
vLLM, the judge's own engine against transformers, and a run with the policy and the judge on vLLM."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from gspo_lab.rewards import Judge, WeightedRewards, build_rewards
from gspo_lab.rewards.base import RewardFunction
from gspo_lab.train import build
from tests.rewards.graders import YES_NO, save_grader

PROMPTS = ["12+34=", "5+6=", "70+8=", "9+90=", "1+1="]
COMPLETIONS = ["46", "11", "7", "99 and more", "2"]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return save_grader(tmp_path_factory.mktemp("judge"), causal=True)


def test_the_verdict_odds_are_each_grading_prompts_own_in_batches(judge_dir):
    """P(y) / (P(y) + P(n)) of the token after the rubric, computed for each prompt alone; batches of 2, left-padded
    with positions counted from each row's first token, give the same to float32 rounding."""
    judge = Judge(str(judge_dir), verdicts=YES_NO, batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    y, n = judge.tokenizer.convert_tokens_to_ids(["y", "n"])
    alone = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS):
        ids = judge.tokenizer(judge.grading_prompt(prompt, completion), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            logits = model(**ids).logits[0, -1]
        alone.append(torch.softmax(logits[[y, n]], -1)[0].item())
    grades = judge(PROMPTS, COMPLETIONS)
    assert grades == pytest.approx(alone, abs=1e-5) and all(0 < g < 1 for g in grades)


def test_an_answer_that_does_not_parse_is_no_reward_and_is_counted(judge_dir):
    """mode=output: the random judge's greedy answers are neither verdict: every completion gets None (no reward,
    out of the baselines), and the failures are counted and logged, never a silent 0."""
    judge = Judge(str(judge_dir), mode="output", verdicts=YES_NO, max_new_tokens=3)
    rewards = WeightedRewards([RewardFunction(judge, name="judge")])
    scores = rewards.score(PROMPTS, COMPLETIONS, [[1]] * 5, {})
    answers = [judge.parse(a) for a in ("y", "n")]
    assert answers == [1.0, 0.0]
    assert scores.applies.tolist() == [False] * 5 and judge.failures == 5
    assert scores.metrics["reward/judge/parse_failures"] == 5.0


def test_the_failure_count_is_kept_in_the_reward_state(judge_dir):
    """A checkpoint's reward state holds the judge's failure count, and a resumed run's judge starts from it."""
    first = Judge(str(judge_dir), mode="output", verdicts=YES_NO, max_new_tokens=2)
    rewards = WeightedRewards([RewardFunction(first, name="judge")])
    rewards.score(PROMPTS[:3], COMPLETIONS[:3], [[1]] * 3, {})
    state = rewards.state_dict()
    assert state["functions"] == {"judge": {"failures": 3}}
    resumed = WeightedRewards([RewardFunction(Judge(str(judge_dir), mode="output", verdicts=YES_NO), name="judge")])
    resumed.load_state_dict(state)
    assert resumed.functions[0].fn.failures == 3


@pytest.mark.parametrize("settings, message", [
    ({"mode": "vibes"}, r"mode='vibes' is invalid"),
    ({"backend": "sglang"}, r"backend='sglang' is invalid: must be hf or vllm"),
    ({"backend": "vllm", "offload": True}, r"offload=true with reward\.functions\.0.backend=vllm"),
    ({"rubric": "Grade: {completion}"}, r"rubric=.* must hold \{prompt\} and \{completion\}"),
    ({"verdicts": {" yes": 1.0, " no": 0.0}}, r"both start with the same token"),
    ({"verdicts": {"y": 1.0}}, r"mode=logprob compares two verdicts"),
    ({"engine_timeout_s": 0}, r"engine_timeout_s=0 is invalid: must be a number > 0"),
])
def test_what_cannot_grade_is_refused_naming_the_key(judge_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        build_rewards({"functions": [{"_target_": "gspo_lab.rewards.Judge", "path": str(judge_dir), **settings}]},
                      None)
    with pytest.raises(ValueError, match=r"reward\.functions\.0.path=.*no causal LM there"):
        build_rewards({"functions": [{"_target_": "gspo_lab.rewards.Judge", "path": str(judge_dir / "none")}]}, None)


def test_a_rubric_may_hold_braces_of_its_own(judge_dir):
    """A rubric that asks for JSON passed the build check, then raised KeyError on every call (str.format read its
    braces as fields), and every reward was 0. Only {prompt} and {completion} are filled in, and braces in a
    completion stay as they are."""
    rubric = 'Q: {prompt}\nA: {completion}\nReply as {"verdict": "y"} or {"verdict": "n"}\nV:'
    judge = Judge(str(judge_dir), rubric=rubric, verdicts=YES_NO)
    assert judge.grading_prompt("1+1=", "{prompt}") == 'Q: 1+1=\nA: {prompt}\nReply as {"verdict": "y"} or ' \
                                                     '{"verdict": "n"}\nV:'
    grades = judge(PROMPTS[:2], COMPLETIONS[:2])
    assert all(0 < g < 1 for g in grades)


# a chat template whose replies open with a thinking mark "[t]" unless enable_thinking=false puts it in the prompt
THINKING = ("{%- set think = not (enable_thinking is defined and enable_thinking is false) -%}"
            "{%- for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}[t]{% endif %}{{ m.content }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% if not think %}[t]{% endif %}{% endif %}")


def test_verdicts_are_checked_against_the_judges_chat_template(judge_dir, tmp_path):
    """A chat judge's reply starts with "Yes" (no space) or its thinking mark, not " yes": the odds of the verdicts'
    first tokens were read where the judge never puts them. Refused at start, naming the key; with thinking off
    (chat_template_kwargs, which reach the template) the same verdicts are its replies' first tokens."""
    for path in judge_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    judge = Judge(str(tmp_path), verdicts=YES_NO)
    judge.tokenizer.chat_template = THINKING
    judge.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"verdicts=.*starts with token .*\[.*chat_template_kwargs"):
        Judge(str(tmp_path), verdicts=YES_NO, key="reward.functions.0")
    thinking_off = Judge(str(tmp_path), verdicts=YES_NO, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.grading_prompt("1+1=", "2").endswith("<assistant>[t]")
    with pytest.raises(ValueError, match=r"reply 'y' starts with token 'y', not ' y'"):
        Judge(str(tmp_path), verdicts={" y": 1.0, "n": 0.0}, chat_template_kwargs={"enable_thinking": False})


def test_a_run_trains_on_the_judges_grades(compose, rl_overrides, judge_dir, updated_batches):
    """reward=judge: the step's rewards are the judge's verdict odds (in (0, 1), one call per round), reward/gold
    sits beside them, and the update moves the policy."""
    run, module, _ = build(compose(rl_overrides + ["reward=judge", f"reward.functions.0.path={judge_dir}",
                                                   "reward.functions.0.verdicts={y: 1.0, n: 0.0}",
                                                   "train.steps=1", "train.eval_every=0"]))
    before = [p.detach().clone() for p in module.model.parameters()]
    run.trainer.fit(module)
    rewards = updated_batches[0].rewards
    assert ((rewards > 0) & (rewards < 1)).all() and "reward/gold" in module.history[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))


@pytest.mark.vllm
def test_a_run_on_vllm_trains_on_the_judges_grades(compose, rl_overrides, vllm_judge_dir):
    """The policy on vLLM and the judge on an engine of its own (reward=judge follows rollout.backend): the rewards
    are its odds, and the run's end stops its engine."""
    pytest.importorskip("vllm")
    run, module, _ = build(compose(rl_overrides + ["rollout.backend=vllm", "reward=judge",
                                                   f"reward.functions.0.path={vllm_judge_dir}",
                                                   "reward.functions.0.verdicts={y: 1.0, n: 0.0}",
                                                   "train.steps=1", "train.eval_every=0"]))
    engine = module.rewards.functions[0].fn.engine
    run.trainer.fit(module)
    assert 0 < module.history[0]["reward/mean"] < 1 and "reward/gold" in module.history[0]
    assert engine is not None and engine.process is None


@pytest.fixture(scope="module")
def vllm_judge_dir(tmp_path_factory):
    return save_grader(tmp_path_factory.mktemp("vllm-judge"), causal=True, head_dim=32)


def test_a_judge_on_vllm_needs_vllm_or_takes_rollout_vllms_settings(judge_dir):
    """backend=vllm is refused where vLLM is not installed; where it is, its settings are rollout.vllm's, checked
    by the same rules and named by the judge's key."""
    entry = {"_target_": "gspo_lab.rewards.Judge", "path": str(judge_dir), "verdicts": YES_NO, "backend": "vllm"}
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"reward\.functions\.0.backend=vllm needs vLLM installed"):
            build_rewards({"functions": [entry]}, None)
        return
    with pytest.raises(ValueError, match=r"reward\.functions\.0.vllm.cpu_kv_cache_gb=0"):
        build_rewards({"functions": [dict(entry, vllm={"cpu_kv_cache_gb": 0})]}, None)
    with pytest.raises(ValueError, match=r"reward\.functions\.0.vllm.dtype is not a setting"):
        build_rewards({"functions": [dict(entry, vllm={"dtype": "bfloat16"})]}, None)


@pytest.mark.vllm
def test_the_judges_own_vllm_engine_grades_as_transformers_does(vllm_judge_dir):
    """backend=vllm: the verdict odds from the engine's prompt log-probs equal transformers' next-token odds (both
    float32; vLLM's CPU kernels round otherwise, so to 1e-4), and its greedy answers are transformers' tokens, parsed
    and counted alike; the engine process is gone after close."""
    pytest.importorskip("vllm")
    hf = Judge(str(vllm_judge_dir), verdicts=YES_NO, batch_size=2)
    served = Judge(str(vllm_judge_dir), verdicts=YES_NO, backend="vllm")
    hf_output = Judge(str(vllm_judge_dir), mode="output", verdicts=YES_NO, max_new_tokens=3)
    try:
        assert served(PROMPTS, COMPLETIONS) == pytest.approx(hf(PROMPTS, COMPLETIONS), abs=1e-4)
        served.mode, served.max_new_tokens = "output", 3
        texts = [hf.grading_prompt(p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
        ids = hf.tokenizer(texts, add_special_tokens=False)["input_ids"]
        engine_answers = served.engine.answers(ids, 3, [hf.tokenizer.eos_token_id])
        inputs = hf.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        out = hf_output.model.generate(**inputs, max_new_tokens=3, do_sample=False,
                                       pad_token_id=hf.tokenizer.pad_token_id)  # as Judge.answers
        ends = {hf.tokenizer.eos_token_id, hf.tokenizer.pad_token_id}  # transformers pads after an end
        assert engine_answers == [[t for t in row if t not in ends] for row in out[:, inputs["input_ids"].shape[1]:]
                                  .tolist()]
        assert served(PROMPTS, COMPLETIONS) == hf_output(PROMPTS, COMPLETIONS)
        assert served.failures == hf_output.failures
        process = served.engine.process
    finally:
        served.close()
    assert not process.is_alive()
