"""Peak memory of the log-prob computation at a 32k vocabulary: gspo-lab's chunked `token_logprobs` against
a naive full float32 log-softmax over [B, T, V], each in its own process, with and without backward, and the
largest difference between their values.

Peak memory is the process's peak resident set above a baseline taken after the model and inputs exist
(ru_maxrss on CPU; torch.cuda.max_memory_allocated on GPU).

    python scripts/bench_logprob_memory.py --rows 64 --length 256 --vocab 32768
    python scripts/bench_logprob_memory.py --rows 8 --length 2048 --vocab 32768 --chunk 8 --chunk-tokens 1024

`--chunk-tokens N` also bounds each chunk to N (row, token) positions (train.logprob_chunk_tokens), so the
chunked peak stays flat as the completion grows.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gspo_lab.rollout import token_logprobs


def peak_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def naive_logprobs(model, ids, mask, completion_len):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()  # [B, T, V]
    logp = logits[:, -completion_len - 1 : -1].log_softmax(-1)  # a full float32 log-softmax
    return logp.gather(-1, ids[:, -completion_len:, None]).squeeze(-1)


def measure(method: str, rows: int, length: int, vocab: int, backward: bool, chunk: int,
            chunk_tokens: int | None = None) -> dict:
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_config(config).to(device)
    ids = torch.randint(0, vocab, (rows, length), device=device)
    mask = torch.ones_like(ids)
    completion = length // 2
    baseline = peak_mib()
    with torch.set_grad_enabled(backward):
        if method == "chunked":
            logp, _ = token_logprobs(model, ids, mask, completion, chunk_rows=chunk, chunk_tokens=chunk_tokens)
        else:
            logp = naive_logprobs(model, ids, mask, completion)
        if backward:
            logp.sum().backward()
    return {"peak_mib": peak_mib() - baseline, "sum": logp.double().sum().item(),
            "values": logp.detach().flatten().tolist()}  # every [B, completion] value, compared in full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=8, help="rows per chunk of the chunked computation")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="(row, token) positions per chunk at most "
                        "(train.logprob_chunk_tokens; default: whole rows)")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "BACKWARD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, backward = args.child[0], args.child[1] == "1"
        print(json.dumps(measure(method, args.rows, args.length, args.vocab, backward, args.chunk, args.chunk_tokens)))
        return
    full = 4 * args.rows * (args.length // 2) * args.vocab / 2**20
    print(f"B={args.rows} T={args.length} (completion {args.length // 2}) V={args.vocab}; one float32 "
          f"[B, completion, V] tensor is {full:.0f} MiB")
    for backward in (False, True):
        results = {}
        for method in ("naive", "chunked"):
            command = [sys.executable, __file__, "--rows", str(args.rows), "--length", str(args.length), "--vocab",
                       str(args.vocab), "--chunk", str(args.chunk), "--child", method, str(int(backward))]
            command += ["--chunk-tokens", str(args.chunk_tokens)] if args.chunk_tokens else []
            results[method] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        difference = max(abs(a - b) for a, b in zip(results["naive"]["values"], results["chunked"]["values"]))
        ratio = results["chunked"]["peak_mib"] / results["naive"]["peak_mib"]
        print(f"  {'forward+backward' if backward else 'forward (no grad)':<18} naive {results['naive']['peak_mib']:7.0f} MiB"
              f"   chunked {results['chunked']['peak_mib']:7.0f} MiB   ratio {ratio:.3f}   max |Δ logp| {difference:.1e}")


if __name__ == "__main__":
    main()
