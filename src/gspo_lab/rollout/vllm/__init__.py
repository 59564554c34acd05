"""rollout.backend=vllm: vLLM's engine beside the trainer.

    engine    the colocated engine (`VLLMEngine`, the backend's class): vLLM's `LLM` in the trainer's process, the
              trainer's weights streamed into it at every sync
    process   the engine in a process of its own, on cores of its own (rollout.async_mode=overlap)
    setup     what the backend needs settled before its engine starts: vLLM's environment, the plan-time refusals,
              the tensors a sync sends

Nothing here imports vLLM until an engine starts or a run is checked.
"""
