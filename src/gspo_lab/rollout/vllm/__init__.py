"""rollout.backend=vllm: vLLM's engine beside the trainer.

    engine    the colocated engine (`VLLMEngine`, the backend's class): vLLM's `LLM` in the trainer's process, the
              trainer's weights streamed into it at every sync
    weights   what a sync sends: the policy's tensors one at a time, gathered from FSDP2's shards, LoRA merged
    experts   the experts the engine routes each token to, captured in its worker (routing.replay=r3)
    calls     what the engine is asked (its arguments, each row's sampling) and what it answers, as Completions
    process   the engine in a process of its own, on cores of its own (rollout.async_mode=overlap)
    setup     what the backend needs settled before its engine starts: vLLM's environment, the plan-time refusals

Nothing here imports vLLM until an engine starts or a run is checked.
"""
