"""The run's random streams are independent: RL does not train on the prompts the cold start just showed
with their answers."""

from hydra.utils import instantiate

from gspo_lab.rollout import PromptSchedule
from gspo_lab.seeding import RL_PROMPTS, SFT_DEMONSTRATIONS, stream_seed
from gspo_lab.sft import Demonstrations, SFTConfig


def test_streams_steps_and_ranks_get_different_seeds():
    seeds = {stream_seed(s, stream, step, rank) for s in range(3) for stream in (RL_PROMPTS, SFT_DEMONSTRATIONS)
             for step in range(50) for rank in range(2)}
    assert len(seeds) == 3 * 2 * 50 * 2


def test_cold_start_and_rl_of_a_default_run_share_no_more_prompts_than_chance(base_cfg):
    """Before the fix RL step s drew exactly the first 16 demonstrations of SFT batch s. Chance: addition of
    two 3-digit numbers has 900 x 900 = 810,000 prompts, about 729,000 of them in the training split, so RL's
    16 prompts meet an SFT batch of 128 in 16 x 128 / 729,000 = 0.003 prompts on average per step, and the
    6,400 RL prompts of 400 steps meet the 57,600 demonstrations of 450 SFT steps in about 506."""
    task = instantiate(base_cfg.task)
    sft = SFTConfig(**base_cfg.sft)
    demonstrations = Demonstrations(task, tokenizer=None, batch_size=sft.batch_size, seed=base_cfg.seed)
    schedule = PromptSchedule(task, base_cfg.rollout.prompts_per_step, base_cfg.seed)
    sft_prompts = [{e.prompt for e in demonstrations.examples(step)} for step in range(450)]
    rl_prompts = [{e.prompt for e in schedule.for_step(step)} for step in range(base_cfg.train.steps)]
    assert sum(len(rl & sft) for rl, sft in zip(rl_prompts, sft_prompts)) <= 2  # chance: 1.2 over 400 steps
    seen_in_sft = set().union(*sft_prompts)
    shared = len(set().union(*rl_prompts) & seen_in_sft)
    expected = 6_400 * len(seen_in_sft) / 729_000
    assert shared < 1.25 * expected, (shared, expected)  # 5 standard deviations above chance (sd ~ 22)
