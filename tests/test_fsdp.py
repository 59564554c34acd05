"""trainer=fsdp on CPU: two gloo processes through Lightning's ModelParallelStrategy and torch's FSDP2 train the
same policy as DDP does from the same seed, and leave a full checkpoint and a loadable final model."""

import csv
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from gspo_lab.models import TinyModel
from gspo_lab.rollout.generation import position_ids
from gspo_lab.sharding import is_sharded, shard
from tests.numerics import RATIO_ROUNDING, assert_rounding_close, logit_scale


def run_two_processes(overrides: list[str], strategy: list[str], run_dir,
                      timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "gspo_lab.train", *overrides, *strategy, "trainer.devices=2", f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def rows(run_dir) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def without_timing(rows_: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))} for row in rows_]


@pytest.mark.slow
def test_fsdp_two_processes_train_the_same_policy_as_ddp(rl_overrides, tmp_path):
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")] + ["train.eval_every=2"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    run_two_processes(overrides, ["trainer=ddp"], ddp)
    result = run_two_processes(overrides, ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true"], fsdp)
    log = result.stdout + result.stderr
    assert "GLOBAL_RANK: 1" in log and "FSDP2: 1 Qwen3MoeDecoderLayer blocks" in log  # really sharded, 2 ranks
    ddp_rows, fsdp_rows = rows(ddp), rows(fsdp)
    assert [r["step"] for r in fsdp_rows] == ["0", "1", "2"]  # written once, by rank 0
    assert fsdp_rows[0]["reward/mean"] == ddp_rows[0]["reward/mean"]  # same seed, same first rollout
    assert float(fsdp_rows[0]["grad_norm"]) > 0  # updates happened, with gradients over all shards
    for key in ("grad_norm", "kl/old", "clip/frac"):  # the first step's updates agree with DDP's
        assert abs(float(fsdp_rows[0][key]) - float(ddp_rows[0][key])) <= 1e-4 * max(1.0, abs(float(ddp_rows[0][key])))
    assert "params/rank_spread" not in fsdp_rows[-1] or fsdp_rows[-1]["params/rank_spread"] == ""  # shards differ
    ddp_final, fsdp_final = load_file(ddp / "final" / "model.safetensors"), load_file(fsdp / "final" / "model.safetensors")
    assert ddp_final.keys() == fsdp_final.keys()
    assert all(fsdp_final[k].shape == ddp_final[k].shape for k in ddp_final)  # full tensors, not shards
    difference = max((fsdp_final[k] - ddp_final[k]).abs().max().item() for k in ddp_final)
    assert difference < 1e-4, difference  # 6e-6 measured: two RL steps apart only by reduction order
    checkpoint = torch.load(fsdp / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["rl_step"] == 2 and checkpoint["state_dict"]


@pytest.mark.slow
def test_fsdp_packed_micro_batches_of_a_token_budget_update_as_ddp_padded_whole_batches(rl_overrides, tmp_path):
    """FSDP2 all-gathers the weights in every forward, so its ranks must run as many micro-batches each: with packed
    forwards in micro-batches of 26 tokens the ranks' own counts differ (tests/test_micro_batch_training.py), they
    agree on the larger, and the first step's update is DDP's with padded whole mini-batches."""
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")] + ["train.eval_every=0",
                                                                                     "train.steps=1"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    run_two_processes(overrides + ["train.padding_free=false"], ["trainer=ddp"], ddp)
    run_two_processes(overrides + ["train.micro_batch_tokens=26", "train.pack_min_saving=0"],
                      ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true"], fsdp)
    ddp_row, fsdp_row = rows(ddp)[0], rows(fsdp)[0]
    assert float(fsdp_row["train/micro_batches"]) > 1 and float(ddp_row["grad_norm"]) > 0
    for key in ("grad_norm", "kl/old", "clip/frac", "loss/policy", "entropy"):
        assert abs(float(fsdp_row[key]) - float(ddp_row[key])) <= 1e-4 * max(1.0, abs(float(ddp_row[key]))), key


@pytest.mark.slow
def test_fsdp_ranks_decode_together_when_their_completions_end_at_different_steps(rl_overrides, tmp_path):
    """Each decode step gathers the sharded weights from every rank, so a rank whose completions have all ended
    keeps stepping until the other's have (generate's synced_gpus): before 2026-11-22 the two ranks deadlocked
    here in the first rollout (the subprocess timed out). Under bf16-mixed, trainer=fsdp's GPU default."""
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
    run = tmp_path / "fsdp"
    run_two_processes(overrides + ["rollout.max_new_tokens=16", "train.eval_every=1"],
                      ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=bf16-mixed"], run, timeout=300)
    written = rows(run)
    assert [r["step"] for r in written] == ["0", "1", "2"] and written[-1]["eval/accuracy"] != ""
    assert all(float(r["completion/len_mean"]) < 16 for r in written[:2])  # completions ended before the limit


@pytest.mark.slow
@pytest.mark.long
def test_fsdp_resumes_from_its_checkpoint_to_the_uninterrupted_metrics(rl_overrides, tmp_path):
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")] + ["train.eval_every=0"]
    strategy = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true"]
    full, part = tmp_path / "full", tmp_path / "part"
    run_two_processes(overrides + ["train.steps=3"], strategy, full)
    run_two_processes(overrides + ["train.steps=2"], strategy, part)
    run_two_processes(overrides + ["train.steps=3", "ckpt_path=last"], strategy, part)  # resumed in place
    assert [r["step"] for r in rows(part)] == ["0", "1", "2"]
    assert without_timing(rows(part)) == without_timing(rows(full))  # weights and optimizer state came back


def test_tied_embeddings_are_refused_before_anything_is_sharded():
    model, _ = TinyModel(arch="qwen3", config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                               "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64,
                                               "tie_word_embeddings": True}).load()
    with pytest.raises(ValueError, match="trainer=fsdp .* tie_word_embeddings=true"):
        shard(model, mesh=None)  # refused before the mesh is touched
    assert not is_sharded(model)


REPLAY = {"r2": ["algorithm=grpo_rr"], "r3": ["algorithm=grpo", "routing.replay=r3", "rollout.logprobs_from_generation=true"]}
STRATEGIES = {"ddp": ["trainer=ddp"], "fsdp": ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(REPLAY))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_routing_replay_under_two_processes_replays_each_ranks_own_rows(strategy, mode, rl_overrides, tmp_path):
    """Each rank records the experts of its own rows (r2: its old-policy forward; r3: its generation) and replays
    them in its update: with one on-policy update, no rank overrides a single expert choice and every GRPO token
    ratio is 1 (the max and min over ranks are logged), and the routers still get gradients (grad_norm > 0)."""
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
    run_dir = tmp_path / "run"
    result = run_two_processes(overrides + REPLAY[mode] + ["train.minibatches=1", "train.steps=1", "train.eval_every=1"],
                               STRATEGIES[strategy], run_dir)
    assert "GLOBAL_RANK: 1" in result.stdout + result.stderr
    first = rows(run_dir)[0]
    assert float(first["rollout/completions"]) == 8  # each rank its own 2 groups of 4
    assert float(first["routing/override_frac"]) == 0 and float(first["clip/frac"]) == 0
    assert abs(float(first["ratio/seq/max"]) - 1) <= RATIO_ROUNDING
    assert abs(float(first["ratio/seq/min"]) - 1) <= RATIO_ROUNDING
    assert float(first["grad_norm"]) > 0 and float(first["routing/changed_frac"]) > 0


REPLAY_ON_RANK = '''
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from gspo_lab.models import TinyModel
from gspo_lab.routing import replay_routing
from gspo_lab.rollout import token_logprobs
from gspo_lab.sharding import is_sharded, shard
payload = torch.load(sys.argv[1], weights_only=False)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, _ = TinyModel(**payload["model"]).load()
model.load_state_dict(payload["state"])
if sys.argv[2] == "fsdp":
    shard(model, init_device_mesh("cpu", (world,)))
model.eval()
rows = torch.arange(rank * 2, rank * 2 + 2)  # this rank's rows of the batch
with torch.no_grad(), replay_routing(model, payload["trace"].rows(rows)) as stats:
    logp, _ = token_logprobs(model, payload["ids"][rows], payload["mask"][rows], payload["C"])
torch.save({"logp": logp, "override_frac": stats.override_frac, "sharded": is_sharded(model)},
           f"{sys.argv[3]}/rank{rank}.pt")
dist.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_rank_replays_its_slice_of_a_trace_like_one_process(strategy, tmp_path):
    """A trace recorded in one process over a 4-row batch, then the routers moved: two gloo ranks (the model
    replicated, or FSDP2-sharded) each replay their 2-row slice of it, and their log-probs equal, to float
    rounding, one process replaying the same slice on the unsharded model."""
    from gspo_lab.rollout import generate, token_logprobs
    from gspo_lab.routing import record_routing, replay_routing
    spec = {"arch": "qwen3_moe", "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
                                             "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                             "tie_word_embeddings": False}}
    torch.manual_seed(0)
    model, tok = TinyModel(**spec).load()
    out = generate(model, tok, ["123+456=", "1+2=", "77+8=", "500+500="], 6)
    ids, mask = torch.cat([out.prompt_ids, out.completion_ids], 1), torch.cat([out.prompt_mask, out.completion_mask], 1)
    C = out.completion_ids.shape[1]
    with torch.no_grad(), record_routing(model) as trace:
        token_logprobs(model, ids, mask, C)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate.weight" in name:
                p.add_(torch.randn_like(p))  # the live routers now choose otherwise: replay must override
    payload = tmp_path / "payload.pt"
    torch.save({"model": spec, "state": model.state_dict(), "trace": trace, "ids": ids, "mask": mask, "C": C}, payload)
    script = tmp_path / "replay_on_rank.py"
    script.write_text(REPLAY_ON_RANK)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script),
                             str(payload), strategy, str(tmp_path)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        rows = torch.arange(rank * 2, rank * 2 + 2)
        with torch.no_grad(), replay_routing(model, trace.rows(rows)):
            expected, _ = token_logprobs(model, ids[rows], mask[rows], C)
            logits = model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=position_ids(mask[rows])).logits
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # the same experts replayed, so equal to rounding: one thread there, this process's threads here, and a
        # sharded model's gathered weights, take other reduction orders (4.8e-7 measured: about 1 rounding)
        assert_rounding_close(got["logp"], expected, scale=logit_scale(logits), units=16)
        assert got["override_frac"] > 0.05 and got["sharded"] == (strategy == "fsdp")
