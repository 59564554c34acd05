"""The RL step's named parts, which gspo_lab.module composes in `training_step`:

    policy.py     PolicyForwards    the policy's forwards: log-probs, shared-prompt forwards, old and reference
    collector.py  RolloutCollector  sample, score, resample zero-std groups, advantages, old and reference
                                    log-probs: a RolloutBatch and the rollout's metrics
    probe.py      MismatchProbe     the engine-trainer mismatch and the routing before and after the updates
    updater.py    Updater           mini-batches, micro-batches, gradient sync, backward, clipping, skips, the
                                    optimizer step, and the state that changes with updates
    metrics.py                      how every metric combines across micro-batches, mini-batches and ranks
    ranks.py      Ranks             this rank, the world and the Lightning strategy, as the parts take them
"""
