"""Backends declare what they can do (gspo_lab.rollout.backend): the plan reads the declarations, never a backend's
name. A setting that needs a capability its backend does not declare is refused with the key, the value and the
capability; a backend of your own that declares it runs; and no module outside rollout/ compares rollout.backend or
rollout.rescore with a name."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from gspo_lab.config import RolloutConfig
from gspo_lab.engine_settings import EngineConfig
from gspo_lab.rollout.backend import BACKENDS, RunSettings, Scorer, backend_class, check_capabilities, scorers
from gspo_lab.rollout.replay import ReplayBackend

SRC = Path(__file__).resolve().parents[2] / "src" / "gspo_lab"
NAMED = {"backend", "rescore"}  # the settings whose values name backends


def checked(backend: type, multi_turn: bool = False, replay: str = "off", **rollout) -> None:
    run = RunSettings(RolloutConfig(**rollout), None, SimpleNamespace(replay=replay), None, None, "cpu", False)
    check_capabilities(backend, run, multi_turn)


@pytest.mark.parametrize("asked, capability", [
    ({"multi_turn": True}, "continues_from_token_ids"),
    ({"max_staleness": 2, "logprobs_from_generation": True}, "samples_synced_weights"),
    ({"replay": "r3"}, "returns_experts"),
    ({"rescore": "hf"}, "returns_logprobs"),
])
def test_what_replayed_completions_cannot_do_is_refused_by_capability(asked, capability):
    with pytest.raises(ValueError, match=rf"with rollout.backend=\S+: .* ReplayBackend does not declare {capability} "
                                         r"= True"):
        checked(ReplayBackend, **asked)


class RecordedWithExperts(ReplayBackend):
    """A backend of a user's own: recorded completions that carry their experts and continue from token ids."""

    continues_from_token_ids = True
    returns_experts = True


def test_a_backend_of_your_own_runs_what_it_declares():
    checked(RecordedWithExperts, multi_turn=True, replay="r3")
    with pytest.raises(ValueError, match=r"RecordedWithExperts does not declare samples_synced_weights"):
        checked(RecordedWithExperts, max_staleness=1, logprobs_from_generation=True)


def test_every_registered_backend_declares_every_capability():
    declared = {"continues_from_token_ids", "samples_synced_weights", "returns_logprobs", "returns_experts",
                "serves_evaluation", "runs_apart"}
    for name in BACKENDS:
        cls = backend_class(name)
        assert {c for c in declared if isinstance(vars(cls).get(c), bool)} == declared, name
        assert isinstance(cls.exact_logprobs(RolloutConfig()), bool)
    assert scorers() == ["hf", "vllm"] and not issubclass(ReplayBackend, Scorer)


def test_the_default_pi_old_follows_what_the_backend_declares():
    """π_old from the engine's own log-probs by default only where they are the trainer forward's, exactly."""
    assert RolloutConfig().logprobs_from_generation is True
    assert RolloutConfig(engine=EngineConfig(precision="bf16")).logprobs_from_generation is False
    assert RolloutConfig(backend="vllm").logprobs_from_generation is False
    assert RolloutConfig(backend="replay", options={"path": "x"}).logprobs_from_generation is False


def name_tests(source: str) -> list[str]:
    """The comparisons in `source` of a backend-naming setting (`x.backend`, `x.rescore`, `x["backend"]`,
    `x.get("backend")`, a variable named so; a backend's `.name`) with a string: `== "vllm"`, `in ("hf", "vllm")`."""
    def names_setting(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in NAMED or node.attr == "name" and any(s.value in BACKENDS for s in constants)
        if isinstance(node, ast.Name):
            return node.id in NAMED
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and node.slice.value in NAMED
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in NAMED
        return False

    def is_name(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in node.elts)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            constants = [s for s in sides if isinstance(s, ast.Constant)]  # an engine's `.name == "vllm"`
            if any(names_setting(s) for s in sides) and any(is_name(s) for s in sides):
                found.append(ast.unparse(node))
    return found


def test_the_name_test_finder_finds_name_tests():
    assert name_tests('if rollout.backend == "vllm": pass') == ["rollout.backend == 'vllm'"]
    assert name_tests('x = cfg["rollout"].get("rescore") in ("hf", "vllm")')
    assert name_tests('ok = "hf" != backend') and name_tests('ok = engine.name == "vllm"')
    assert not name_tests('ok = task.name == "gsm8k"')
    assert not name_tests('x = rollout.backend == other.backend or backend_class(rollout.backend).runs_apart')


def test_no_module_outside_rollout_compares_a_backend_with_a_name():
    """Before backends declared their capabilities this found 7 (config.py 4, besides its RESCORERS tuple; plan.py,
    eval_sets.py, report/runs.py 1 each). The judge's own engine (rewards/judge.py: judge.backend) is another
    setting, of the judge; it is kept apart here by its path."""
    found = {str(path.relative_to(SRC)): name_tests(path.read_text()) for path in SRC.rglob("*.py")
             if "rollout" not in path.relative_to(SRC).parts[:1] and path.name != "judge.py"}
    assert {path: tests for path, tests in found.items() if tests} == {}
