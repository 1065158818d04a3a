"""Factorized-FL, domain heterogeneity: 5 groups of 4 clients with disjoint label
sets (each group's classes relabelled 0..K/5-1), labels permuted per client.

    python -m experiments.main --workdir=runs/ffl_dom \\
        --config=experiments/configs/factorized_fl_domains.py
    # ":permuted,cifar100 --config.data_dir=DIR" for CIFAR-100 (20 classes per group);
    # ",small" for a quick run

The argument is "[permuted|relabelled][,<dataset>][,small]" (see
factorized_fl_labels.py for datasets): "relabelled" keeps each group's labels
identical across its clients (no per-client permutation). Factorized-FL settings
are the release's domain ones: tau 0.95, epsilon 20, min_keep 4 (the group
size), head local. summary.json reports the collaboration within vs across groups.
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs import default
from pfljax.experiment.configs.factorized_fl_labels import apply_dataset, parse

SCENARIOS = ("permuted", "relabelled")


def get_config(arg: str = "permuted") -> ml_collections.ConfigDict:
    scenario, dataset, small = parse(arg, SCENARIOS)
    config = default.get_config()
    config.algorithm = "factorized_fl"
    config.num_clients = 20
    config.rounds = 100
    config.partition = "groups"
    config.num_groups = 5
    config.group_relabel = True
    config.permute_labels = "client" if scenario == "permuted" else "none"
    apply_dataset(config, dataset, small)
    ffl = config.factorized_fl
    ffl.tau, ffl.epsilon, ffl.min_keep = 0.95, 20.0, 4
    ffl.lambda_sparse = 5e-4
    ffl.head_local = True
    config.fedavg.local_leaves = ("params/head/",)
    return config
