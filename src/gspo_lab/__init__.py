"""gspo-lab: GSPO, GSPO-token and GRPO with routing replay on Lightning, transformers and Hydra."""

from pathlib import Path

from omegaconf import OmegaConf

# conf/ at the repository root (the package is installed editable from src/)
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")

# ${mul:a,b} in configs, e.g. Lightning's optimizer-step counts from RL steps x mini-batches
OmegaConf.register_new_resolver("mul", lambda a, b: a * b, replace=True)
