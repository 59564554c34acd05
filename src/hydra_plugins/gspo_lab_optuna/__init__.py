"""The resumable Optuna sweeper as a Hydra plugin: Hydra instantiates plugins only from the hydra_plugins
namespace. The work is gspo_lab.sweeper's, imported when the sweeper is built, so Hydra's plugin scan at every
launch does not import optuna (as hydra-optuna-sweeper's own OptunaSweeper)."""

from typing import Any

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper


class ResumableOptunaSweeper(OptunaSweeper):
    """hydra/sweeper=optuna with `_target_: hydra_plugins.gspo_lab_optuna.ResumableOptunaSweeper`: the same
    options, and n_trials is the study's total (gspo_lab/sweeper.py)."""

    def __init__(self, **options: Any) -> None:
        from gspo_lab.sweeper import ResumableOptunaSweeperImpl

        self.sweeper = ResumableOptunaSweeperImpl(**options)
