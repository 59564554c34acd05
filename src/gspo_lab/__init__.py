"""gspo-lab: GSPO, GSPO-token and GRPO with routing replay on Lightning, transformers and Hydra."""
