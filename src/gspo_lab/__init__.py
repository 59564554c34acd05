"""gspo-lab: GSPO, GSPO-token and GRPO with routing replay on Lightning, transformers and Hydra."""

from pathlib import Path

# conf/ at the repository root (the package is installed editable from src/)
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")
