"""FedFac simulation study (Sec. 4.3 of arXiv 2312.04281): model (8), C=100, d=100, m=200.

    python -m experiments.main --config=experiments/configs/fedfac_simulation.py:dynamic \\
        --config.source.p=0.3 --config.seed=1 --workdir=/tmp/fedfac_sim

The argument after ":" picks the split variant (default "dynamic"): true, static,
dynamic, dynamic_updates, eig, random, random_static, fedavg, all_personalized,
local (see experiments/studies/fedfac_study.py for what each one is; "true" is the
paper's name for the true split; the paper's
"oracle", the generator's own decision function, trains nothing and is in the
study only). The split
variants personalize the generator's number of personalized units,
tau_quantile = 100 (1 - p): after changing `source.p`, set
`--config.fedfac.tau_quantile` to match. Paper grid: p in {0.3, 0.5, 0.7} with
alpha=0.4, and alpha in {0.2, 0.4, 0.6} with p=0.5. `experiments/studies/fedfac_study.py`
runs the whole grid directly through the library.
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs import default

VARIANTS = {
    "true": dict(split="fixed"),
    "static": dict(mode="static"),
    "dynamic": dict(mode="dynamic"),
    "dynamic_updates": dict(mode="dynamic", split_input="updates"),
    "eig": dict(mode="dynamic", method="eig"),
    "random": dict(mode="dynamic", split="random"),
    "random_static": dict(mode="static", split="random"),
    "all_personalized": dict(split="fixed", tau_quantile=100.0),
}


def get_config(variant: str = "dynamic") -> ml_collections.ConfigDict:
    config = default.get_config()
    config.dataset = "simulation"
    config.partition = "iid"
    config.num_clients = 100
    config.clients_per_round = 0
    config.samples_per_client = 0
    config.source.samples_per_client, config.source.p, config.source.alpha = 500, 0.5, 0.4
    config.rounds = 300
    config.local_epochs = 1
    config.batch_size = 32
    config.optimizer = "sgd"
    config.learning_rate = 0.05
    config.momentum = 0.9
    config.model = "mlp"
    config.model_kwargs = ml_collections.ConfigDict({"hidden": (200,)})
    config.eval_every = 10
    if variant == "fedavg":
        config.algorithm = "fedavg"
    elif variant == "local":
        config.algorithm = "local"
    elif variant in VARIANTS:
        config.algorithm = "fedfac"
        config.fedfac.layers = (0,)
        config.fedfac.kappa = 0.85
        config.fedfac.tau_quantile = 100.0 * (1.0 - config.source.p)
        config.fedfac.update(VARIANTS[variant])
    else:
        raise ValueError(f"variant must be one of {sorted([*VARIANTS, 'fedavg', 'local'])}, got {variant!r}")
    return config
