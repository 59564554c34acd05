"""gspo-export: a run's checkpoints as folders transformers loads as they are; LoRA adapters and the merged model."""

import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from gspo_lab.cold_start import policy_from_config
from gspo_lab.export import main, read_checkpoint
from gspo_lab.train import train

PROMPTS = ["12+3=", "999+1="]


def logits(model, tokenizer):
    ids = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**ids).logits


def test_any_checkpoint_of_a_run_exports_to_a_folder_transformers_loads(compose, rl_overrides, tmp_path):
    train(compose(rl_overrides + ["train.ckpt_every=1", "callbacks.checkpoint.save_top_k=-1"]))
    run = tmp_path / "run"
    main([str(run), str(tmp_path / "last")])
    main([str(run / "checkpoints" / "rl_step=1.ckpt"), str(tmp_path / "step1")])
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    last = AutoModelForCausalLM.from_pretrained(tmp_path / "last")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "last")
    tokenizer.padding_side = "left"
    # bitwise: the same weights through the same operations on the same shapes in one process
    assert torch.equal(logits(last, tokenizer), logits(final, tokenizer))
    assert not torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "step1"), tokenizer),
                           logits(final, tokenizer))  # one RL step earlier
    assert (tmp_path / "last" / "generation_config.json").is_file()
    with pytest.raises(SystemExit, match=r"gspo-export: .*nothing: neither a run dir"):
        main([str(tmp_path / "nothing"), str(tmp_path / "x")])


def test_a_lora_run_exports_its_adapters_and_on_request_the_merged_model(compose, rl_overrides, tmp_path):
    """verl's merger once wrote the base weights unchanged (verl issue #7285): the merged model must be the
    adapted one, not the base."""
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "train.lr=1e-2"]
    cfg = compose(rl_overrides + lora)
    train(cfg)
    main([str(tmp_path / "run"), str(tmp_path / "out"), "--merge"])
    base, tokenizer, _ = policy_from_config(cfg, instantiate(cfg.task))
    before = logits(base, tokenizer)
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out"), tokenizer)
    adapted = logits(PeftModel.from_pretrained(base, tmp_path / "out" / "adapter"), tokenizer)
    assert (merged - before).abs().max() > 1e-4  # not the base weights
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)  # W + BA against x W + x B A: rounding


def mapped_from(path: Path, tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory is a mapping of the file at `path` (Linux's /proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in span.split("-"))
        if name.strip() == str(path) and start <= address < end:
            return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_checkpoint_is_memory_mapped_so_its_optimizer_states_are_never_read(tmp_path):
    """gspo-export and gspo-eval read the weights of a checkpoint that also holds AdamW's two moments per weight:
    mapped from the file, pages of the optimizer states are never read into memory."""
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model.w": torch.ones(3)},
                "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}}]}, path)
    checkpoint = read_checkpoint(path)
    assert torch.equal(checkpoint["state_dict"]["model.w"], torch.ones(3))
    assert mapped_from(path.resolve(), checkpoint["optimizer_states"][0]["state"][0]["exp_avg"])
