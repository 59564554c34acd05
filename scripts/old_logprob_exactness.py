"""How far the old log-probs are from the training forward's on-policy log-probs, by where they come from.

Before any update the policy ratio is exactly 1 in exact arithmetic; in float arithmetic it is not. For a
few rollouts of a workload this prints, against the training forward of one mini-batch (the log-probs the
objective differentiates):
  generation  log-probs from generate's own logits (rollout.logprobs_from_generation=true, the default)
  forward     a no-grad forward over the whole rollout batch (rollout.logprobs_from_generation=false)
as the largest per-token |log-ratio| and the largest per-sequence |mean log-ratio| (log s_i of GSPO), beside
the objective's clip range. Run it when you change the model, dtype or device. It runs where and as the RL
step runs: on the trainer's device, inside its precision plugin's training context (bf16 autocast under
`trainer.precision=bf16-mixed`, the default of `trainer=gpu`).

    python scripts/old_logprob_exactness.py                          # the default policy after its cold start
    python scripts/old_logprob_exactness.py experiment=bench_anchor  # random init
    python scripts/old_logprob_exactness.py trainer=gpu              # on a GPU, under bf16 autocast
    python scripts/old_logprob_exactness.py trainer.precision=bf16-mixed   # CPU bf16 autocast
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from hydra import compose, initialize_config_dir

from gspo_lab import CONFIG_DIR
from gspo_lab.rollout import generate, token_logprobs
from gspo_lab.train import build


def deviations(reference: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Largest |token log-ratio| and largest |length-normalised sequence log-ratio| over the rows."""
    diff = (reference - other) * mask  # [B, C]
    sequence = diff.sum(-1) / mask.sum(-1).clamp(min=1)  # [B] log s_i
    return diff.abs().max().item(), sequence.abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=3, help="rollout batches to measure")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={out}", *args.overrides])
        run, module, _ = build(cfg)
    module.model.to(run.trainer.strategy.root_device).eval()  # as RLModule keeps it
    with run.trainer.precision_plugin.train_step_context():  # what Lightning wraps the RL step in
        measure(module, cfg, args.rollouts, run.trainer.precision)


def measure(module, cfg, rollouts: int, precision: str) -> None:
    model, tokenizer, rollout = module.model, module.tokenizer, module.rollout_cfg
    rows = -(-rollout.prompts_per_step * rollout.group_size // module.train_cfg.minibatches)  # one mini-batch
    print(f"clip range of {module.objective.name}: -{cfg.objective.clip_low:g} / +{cfg.objective.clip_high:g} "
          f"(on the sequence ratio for GSPO, the token ratio for GRPO); mini-batch of {rows} rows; "
          f"{next(model.parameters()).device}, trainer.precision={precision}")
    print("rollout | source     | max |token log-ratio| | max |sequence log-ratio|")
    for step in range(rollouts):
        torch.manual_seed(step)
        grouped = [e.prompt for e in module.collector.rows.examples(step)]
        out = generate(model, tokenizer, grouped, rollout.max_new_tokens, temperature=rollout.temperature,
                       top_p=rollout.top_p, suppress_eos=rollout.suppress_eos, return_logprobs=True,
                       share_prompts=rollout.share_prompt_prefill)
        ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
        length, chunk = out.completion_ids.shape[1], module.train_cfg.logprob_chunk_rows
        share = module.train_cfg.share_prompt_forward  # each prompt once where that saves enough, as in training
        with torch.no_grad():
            forward, _ = token_logprobs(model, ids, mask, length, rollout.temperature, chunk, share_prompts=share)
        training, _ = token_logprobs(model, ids[:rows], mask[:rows], length, rollout.temperature, chunk,
                                     share_prompts=share)
        completion = out.completion_mask[:rows].float()
        for source, old in (("generation", out.logprobs), ("forward", forward)):
            token, sequence = deviations(training.detach(), old[:rows], completion)
            print(f"{step:7d} | {source:10s} | {token:21.2e} | {sequence:24.2e}")


if __name__ == "__main__":
    main()
