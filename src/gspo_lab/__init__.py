"""gspo-lab: GSPO, GSPO-token and GRPO with routing replay on Lightning, transformers and Hydra."""

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parent
# A wheel carries the Hydra configs as gspo_lab/conf. Run from a checkout (an editable install, or
# PYTHONPATH=src) the package has none, and the configs are conf/ at the root of that checkout, the one copy
# users edit; SOURCE_ROOT is that checkout, and None for an installed wheel.
SOURCE_ROOT = None if (PACKAGE_DIR / "conf").is_dir() else PACKAGE_DIR.parents[1]
CONFIG_DIR = str(PACKAGE_DIR / "conf" if SOURCE_ROOT is None else SOURCE_ROOT / "conf")

# ${mul:a,b} and ${idiv:a,b} in configs, e.g. a clip range times clip_scale
OmegaConf.register_new_resolver("mul", lambda a, b: a * b, replace=True)
OmegaConf.register_new_resolver("idiv", lambda a, b: a // b, replace=True)
# ${is_set:value}: whether a key holds a value (experiment=partial_rollouts: rollout.partial where segment_tokens is set)
OmegaConf.register_new_resolver("is_set", lambda value: value is not None, replace=True)
# ${config_dir:}: the folder of these configs (conf/experiment/bench_varlen.yaml's recorded completions sit there)
OmegaConf.register_new_resolver("config_dir", lambda: CONFIG_DIR, replace=True)
# ${truncate:text,n}: sweep subdir names stay under the 255-byte file-name limit however many overrides
OmegaConf.register_new_resolver("truncate", lambda text, n: str(text)[:n], replace=True)


def _sweep_group() -> str | None:
    """${sweep_group:}: the multirun's sweep dir (so one sweep's wandb runs share a group); null otherwise."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return HydraConfig.get().sweep.dir
    return None


OmegaConf.register_new_resolver("sweep_group", _sweep_group, replace=True)
