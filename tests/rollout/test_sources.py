"""Where rollouts come from is one interface (gspo_lab.rollout.sources): the factory picks one source per setting,
the collector holds a source and no lag or overlap of its own, and no module reaches into another's private
names."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import gspo_lab
from gspo_lab.step.collector import RolloutCollector
from gspo_lab.train import build

SRC = Path(gspo_lab.__file__).parent


@pytest.mark.parametrize("settings, source", [
    ([], "SynchronousSource"),
    (["rollout.max_staleness=2"], "LaggedSource"),
    (["rollout.max_staleness=2", "rollout.partial=true", "rollout.segment_tokens=3"], "LaggedSource"),
])
def test_the_factory_picks_the_source_the_settings_name(settings, source, compose, rl_overrides):
    _, module, _ = build(compose(rl_overrides + settings + ["rollout.logprobs_from_generation=true"]))
    assert type(module.source).__name__ == source and module.collector.source is module.source
    assert module.source.in_process
    module.close()


def test_the_collector_takes_a_source_and_keeps_no_lag_or_overlap_of_its_own():
    parameters = list(inspect.signature(RolloutCollector.__init__).parameters)[1:]
    assert len(parameters) <= 10 and "source" in parameters
    tree = ast.parse((SRC / "step" / "collector.py").read_text())
    own = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
           and isinstance(node.value, ast.Name) and node.value.id == "self"}
    assert not own & {"lag", "overlap", "rescorer", "backend", "version"}


def test_no_module_imports_another_modules_private_names():
    """A private name (a leading underscore) is its module's own: overlap imported vLLM's `_reload` until it became
    public (vllm.weights.reload_in_worker)."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gspo_lab"):
                found += [f"{path.relative_to(SRC)}: {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert found == []
