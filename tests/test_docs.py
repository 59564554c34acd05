"""The generated documentation pages against their sources."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from gspo_lab.report.study import report
from scripts import config_reference, doc_commands
from scripts.config_reference import CONF, PAGE, ROOT, parse, render


def make_docs_command() -> list[str]:
    """The mkdocs command line of `make docs` (the Makefile's), run with this interpreter."""
    line = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "mkdocs build" in line)
    return [sys.executable, "-m", "mkdocs", *line.split("bin/mkdocs", 1)[1].split()]


@pytest.mark.slow
def test_make_docs_fails_on_a_broken_link(tmp_path):
    """The site built by `make docs` from a copy of the docs with one link broken: it fails, naming the link."""
    for package in ("mkdocs", "material", "mkdocstrings"):
        pytest.importorskip(package, reason="the docs extras: make docs installs them")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for name in ("mkdocs.yml", "mkdocs_hooks.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("src", "experiments"):  # the API reference's sources; the studies the hook adds
        (tmp_path / name).symlink_to(ROOT / name)
    page = tmp_path / "docs" / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    built = subprocess.run([*make_docs_command(), "--site-dir", str(tmp_path / "site")], cwd=tmp_path,
                           capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode != 0 and "no-such-page.md" in built.stderr, built.stderr[-3000:]


def test_the_config_reference_page_is_up_to_date_with_conf():
    assert PAGE.read_text() == render(), "docs/reference/config.md is stale: run python scripts/config_reference.py"


def test_an_option_s_keys_defaults_and_comments(tmp_path):
    path = tmp_path / "opt.yaml"
    path.write_text(
        "# @package _global_\n"
        "# What this option does,\n# in two lines.\n"
        "defaults:\n  - override /model: tiny  # a trailing comment\n\n"
        "# seeds everything\nseed: 3\n"
        "train:\n  # the step count\n  steps: 40  # forty\n\n  # orphaned by the blank line below\n\n"
        "  name: \"a # not a comment\"\n  sizes: [1, 2]\n"
        "  nested:\n    deep: ${train.steps}\n"
        "functions:\n  - _target_: a.B\n    weight: 1.0\n  - c\n"
        "top: {x: 1}\n"
    )
    description, keys = parse(path)
    assert description == "What this option does, in two lines."
    assert [(k.path, k.default, k.comment, k.items) for k in keys] == [
        ("defaults", "", "", ["override /model: tiny"]),
        ("seed", "3", "seeds everything", []),
        ("train", "", "", []),
        ("train.steps", "40", "the step count", []),
        ("train.name", '"a # not a comment"', "", []),
        ("train.sizes", "[1, 2]", "", []),
        ("train.nested", "", "", []),
        ("train.nested.deep", "${train.steps}", "", []),
        ("functions", "", "", ["_target_: a.B, weight: 1.0", "c"]),
        ("top", "{x: 1}", "", []),
    ]


def mapping_keys(node, prefix: str = "") -> set[str]:
    """Every dotted key of a YAML mapping, as OmegaConf reads it (lists are leaves)."""
    found = set()
    for key in node.keys() if isinstance(node, DictConfig) else []:
        path = f"{prefix}{key}"
        found.add(path)
        found |= mapping_keys(node._get_node(key), f"{path}.")
    return found


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: p.relative_to(CONF).as_posix())
def test_the_line_parser_finds_every_key_a_yaml_parser_finds(path):
    """The reference's keys of each conf/ file are exactly the keys OmegaConf reads from it (a flow mapping,
    {a: 1, b: 2}, is one key whose default is the mapping)."""
    keys = parse(path)[1]
    flows = [f"{key.path}." for key in keys if key.default.startswith("{")]
    expected = {k for k in mapping_keys(OmegaConf.load(path)) if not k.startswith(tuple(flows))}
    assert {key.path for key in keys} == expected, config_reference.__file__


README = config_reference.ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_a_front_door_not_a_notebook():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "README.md: at most ~250 lines; reference material belongs in docs/"
    assert not re.search(r"\b[Ii]ssue \d+|\bsession \d+", text), "README.md names an issue or a session"
    assert not re.search(r"MEASURED_|TODO|XXX", text), "README.md holds a placeholder"


def test_every_relative_link_of_the_readme_resolves():
    targets = [t for t in LINK.findall(README.read_text()) if "://" not in t]
    assert targets, "the parser found no link"
    missing = [t for t in targets if not (README.parent / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.parametrize("name", doc_commands.FILES)
def test_the_documented_commands_are_ones_a_newcomer_can_type(name):
    """No placeholder (`<run dir>`) in a command the doc runner will run, and every training command shortened."""
    listed = doc_commands.commands((config_reference.ROOT / name).read_text())
    assert listed, f"{name}: no ```bash block"
    for command in listed:
        assert not re.search(r"<[a-z_ ]+>", command), f"{name}: a placeholder in a runnable command: {command}"
        shortened = doc_commands.tiny(command)
        if command.startswith(("gspo-train", "make train")):
            assert "train.steps=2" in shortened and "sft.steps=25" in shortened, shortened


# studies whose report inputs are committed (scripts/study_data.py) -> the --baseline their report was made with
COMMITTED_STUDIES = {"paper_main": "algorithm=gspo", "routing_replay": "algorithm=grpo routing.replay=off",
                     "clip_range": "algorithm=gspo clip_scale=1.0",
                     "length_norm": "objective.length_norm=True",
                     "off_policy": "train.minibatches=4",
                     "group_size": "rollout.group_size=8",
                     "expert_volatility": "model.config.num_hidden_layers=4 train.lr=3e-05",
                     "real_engine": "algorithm=grpo rollout.logprobs_from_generation=False",
                     "real_engine/followup": "rollout.logprobs_from_generation=False",
                     "entropy": "algorithm=grpo",
                     "clip_lr/byo": "algorithm=grpo clip_scale=1.0 train.lr=0.0001",
                     "clip_lr/default": "algorithm=grpo clip_scale=1.0 train.lr=0.0001",
                     "clip_lr/low_start": "algorithm=gspo clip_scale=1.0",
                     "multi_turn/calculator": "algorithm=gspo", "multi_turn/guess_number": "algorithm=gspo",
                     "staleness": "algorithm=gspo correction=bypass rollout.max_staleness=0",
                     "overoptimization": "algorithm=gspo objective.beta=0.0",
                     "engine_r3": "algorithm=grpo_rr",
                     "partial_rollouts": "algorithm=gspo correction=bypass rollout.max_staleness=0"}
# a study's other gspo-report options, where it has any (a folder below a study: one of its tasks)
CLIP_LR = {"grid": ("train.lr", "clip_scale"), "grid_baseline": "1.0", "setting_figures": False}
STUDY_OPTIONS = {"entropy": {"metric": "entropy"}, "clip_lr/byo": CLIP_LR, "clip_lr/default": CLIP_LR,
                 "clip_lr/low_start": CLIP_LR,
                 "multi_turn/guess_number": {"metric": "eval/heldout/reward/environment_reward/greedy"},
                 "overoptimization": {"metric": "reward/gold"}}


def option_text(options: dict) -> str:
    """gspo-report's command-line spelling of report()'s options (False: the flag --no-<option>)."""
    return "".join(f" --no-{key.replace('_', '-')}" if v is False else
                   f" --{key.replace('_', '-')} {','.join(v) if isinstance(v, tuple) else v}"
                   for key, v in options.items())


@pytest.mark.parametrize("study", sorted(COMMITTED_STUDIES))
def test_a_study_s_report_and_figures_come_from_its_committed_runs(study, tmp_path, monkeypatch):
    """A study that commits what gspo-report reads (runs/): its report.md is what they give, its figures too."""
    monkeypatch.chdir(config_reference.ROOT)  # the report's title names the dir as given
    folder = Path("experiments") / study
    options = STUDY_OPTIONS.get(study, {})
    report([folder / "runs"], tmp_path, baseline=COMMITTED_STUDIES[study], **options)
    assert (tmp_path / "report.md").read_text() == (folder / "report.md").read_text(), (
        f"{folder}/report.md is not what its runs/ give: run gspo-report {folder}/runs "
        f"--baseline '{COMMITTED_STUDIES[study]}'{option_text(options)} --out {folder}")
    # the figures the study's README shows from this folder (a task's folder: those under it)
    study_root, below = Path("experiments") / study.split("/")[0], "/".join(study.split("/")[1:])
    prefix = re.escape(below + "/") if below else ""
    shown = re.findall(rf"!\[[^\]]*\]\({prefix}([^)/]+\.png)\)", (study_root / "README.md").read_text())
    assert shown and all((tmp_path / name).is_file() for name in shown), shown


def test_every_study_with_committed_runs_is_checked():
    experiments = config_reference.ROOT / "experiments"
    committed = {path.parent.relative_to(experiments).as_posix() for path in experiments.glob("**/runs")
                  if "runs" not in path.parent.relative_to(experiments).parts}  # not a folder inside runs/
    assert committed == set(COMMITTED_STUDIES), "add the study and its --baseline to COMMITTED_STUDIES"
