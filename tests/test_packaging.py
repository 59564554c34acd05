"""Installing as any Python package does: pyproject lists every package and config group, a built wheel
carries conf/ as gspo_lab/conf and runs from an empty folder, and only a checkout lends run_info its git SHA."""

import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import gspo_lab
from gspo_lab.report.run import git_sha

ROOT = Path(__file__).resolve().parents[1]
BUILDS_HERE = "--no-build-isolation builds with this venv's setuptools (no network); `make` installs it"


def test_a_checkout_reads_the_configs_from_its_top_level_conf():
    assert gspo_lab.SOURCE_ROOT == ROOT and Path(gspo_lab.CONFIG_DIR) == ROOT / "conf"


def test_pyproject_lists_every_package_and_config_group():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {".".join(p.parent.relative_to(ROOT / "src").parts) for p in (ROOT / "src").rglob("__init__.py")}
    groups = {f"gspo_lab.conf.{d.name}" for d in (ROOT / "conf").iterdir() if any(d.glob("*.yaml"))}
    # hydra_plugins: the namespace Hydra scans for plugins (no __init__.py); an editable install adds the
    # checkout's hydra_plugins/ to it only when it is listed
    assert sorted(setuptools["packages"]) == sorted(packages | groups | {"gspo_lab.conf", "hydra_plugins"})
    assert setuptools["package-dir"] == {"": "src", "gspo_lab.conf": "conf"}


def commit(repo: Path) -> str:
    """A repository at `repo` with one empty commit; returns its SHA."""
    repo.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "start"], check=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def test_git_sha_is_the_checkouts_own_and_unknown_elsewhere(tmp_path):
    sha = commit(tmp_path / "project")
    assert git_sha(tmp_path / "project") == sha
    # a venv inside some other repository, holding an installed wheel: not that repository's SHA
    installed = tmp_path / "project" / ".venv" / "lib" / "site-packages" / "gspo_lab"
    installed.mkdir(parents=True)
    assert git_sha(installed) == "unknown"
    assert git_sha(None) == "unknown"


def python_with_only(path: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python *args` in `cwd` with PYTHONPATH=`path` alone (the test run's own src/ left out)."""
    env = {**os.environ, "PYTHONPATH": str(path), "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def copy_checkout(out: Path) -> Path:
    """What a build reads, copied, so building leaves no build/ or egg-info in the checkout."""
    source = out / "source"
    for name in ("src", "conf"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    return source


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--no-deps", "--no-build-isolation"], check=True,
                   capture_output=True)


def test_a_built_wheel_carries_the_configs_and_runs_from_an_empty_folder(tmp_path):
    pytest.importorskip("setuptools", minversion="77", reason=BUILDS_HERE)
    pip("wheel", str(copy_checkout(tmp_path)), "-w", str(tmp_path / "dist"))
    wheel = next((tmp_path / "dist").glob("gspo_lab-*.whl"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"gspo_lab/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    modules = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src").rglob("*.py")}
    assert configs | modules <= shipped
    target = tmp_path / "target"
    pip("install", "--target", str(target), str(wheel))
    empty = tmp_path / "empty"
    empty.mkdir()
    job = python_with_only(target, ["-m", "gspo_lab.train", "--cfg", "job"], empty)
    assert job.returncode == 0, job.stderr[-2000:]
    assert "_target_: gspo_lab.config.RolloutConfig" in job.stdout
    where = python_with_only(target, ["-c", "import gspo_lab, gspo_lab.report.run as run; "
                                     "print(run.__file__, run.git_sha(gspo_lab.SOURCE_ROOT), gspo_lab.CONFIG_DIR)"], empty)
    assert where.stdout.split() == [str(target / "gspo_lab" / "report" / "run.py"), "unknown",
                                    str(target / "gspo_lab" / "conf")], where.stderr[-2000:]
    assert list(empty.iterdir()) == []  # --cfg job only prints; no outputs/ in the user's folder


def test_an_editable_install_reads_its_checkouts_conf(tmp_path):
    pytest.importorskip("setuptools", minversion="77", reason=BUILDS_HERE)
    source, target = copy_checkout(tmp_path), tmp_path / "target"
    pip("install", "--target", str(target), "--editable", str(source))
    # -S and the venv's site-packages as plain paths: its .pth files stay unread, so an editable install of the
    # checkout under test (the venv's own) cannot answer instead of the one in `target`. `target` comes first:
    # its .pth imports a finder module whose name the venv's own editable install shares
    code = (f"import site, sys; site.addsitedir({str(target)!r}); sys.path += {site.getsitepackages()!r}; "
            "import gspo_lab; print(gspo_lab.__file__, gspo_lab.CONFIG_DIR)")
    where = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": ""}, timeout=300)
    assert where.stdout.split() == [str(source / "src" / "gspo_lab" / "__init__.py"), str(source / "conf")], where.stderr
