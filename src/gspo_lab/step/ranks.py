"""This rank, the world and the Lightning strategy, as the RL step's parts take them (gspo_lab.module builds one
per step): the parts never reach into the LightningModule."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Ranks:
    rank: int  # this process's global rank
    world: int  # the number of ranks
    device: torch.device  # where Lightning put the policy
    strategy: object  # Lightning's strategy: reduce, reduce_boolean_decision, block_backward_sync

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank; collective: every rank calls it."""
        return self.strategy.reduce_boolean_decision(flag, all=False)

    def agree(self, count: int) -> int:
        """The largest `count` over the ranks (every rank calls it; one all-reduce where there are several)."""
        if self.world == 1:
            return count
        return int(self.strategy.reduce(torch.tensor(count, device=self.device), reduce_op="max").item())
