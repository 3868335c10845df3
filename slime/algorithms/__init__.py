"""RL algorithms as pure tensor functions, shared by both trainers, each kind in one registry.

| kind               | registry               | decorator                       | flag                    |
|--------------------|------------------------|---------------------------------|-------------------------|
| advantage estimator | `ADVANTAGE_ESTIMATORS` | `register_advantage_estimator`  | `--advantage-estimator` |
| policy loss        | `POLICY_LOSSES`        | `register_policy_loss`          | `--loss-type`           |
| KL estimator       | `KL_ESTIMATORS`        | `register_kl_estimator`         | `--kl-loss-type`        |
| loss aggregation   | `LOSS_AGGREGATIONS`    | `register_loss_aggregation`     | `--loss-agg-mode`       |

A new algorithm is one decorated function in one file. Put yours in a module and pass its dotted path to
`--custom-algorithm-module`: it is imported before the flags' choices are checked and in every trainer
process, so its names become valid flag values. Nothing here imports the rest of slime.
"""

from slime.algorithms.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator
from slime.algorithms.aggregation import LOSS_AGGREGATIONS, register_loss_aggregation
from slime.algorithms.kl import KL_ESTIMATORS, register_kl_estimator
from slime.algorithms.policy_losses import POLICY_LOSSES, loss_type_choices, register_policy_loss
from slime.algorithms.registry import Registry, load_user_registrations

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "Registry",
    "load_user_registrations",
    "loss_type_choices",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_loss_aggregation",
    "register_policy_loss",
]
