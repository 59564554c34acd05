"""Seeds of the run's random streams: each stream (the cold start's demonstrations, the RL prompts, the RL
sampling, the LoRA adapters' initialisation) derives its own seed from (run seed, stream name, step), so no two
streams draw the same values.

>>> stream_seed(0, "rl_prompts", 3) == stream_seed(0, "rl_prompts", 3)
True
>>> stream_seed(0, "rl_prompts", 3) == stream_seed(0, "sft_demonstrations", 3)
False
"""

from __future__ import annotations

import hashlib

LORA_INIT = "lora_init"
RL_PROMPTS = "rl_prompts"
RL_SAMPLING = "rl_sampling"
SFT_DEMONSTRATIONS = "sft_demonstrations"


def stream_seed(seed: int, stream: str, step: int, rank: int = 0) -> int:
    """A 63-bit seed for one step of one stream: a hash of all four, so nearby seeds or steps of different
    streams never collide the way `seed * c + step` can."""
    digest = hashlib.blake2b(f"{stream}/{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
