"""FedeRiCo on Fashion-MNIST groups: 8 clients in 2, 3 or 4 groups, data-scarce.

    python -m experiments.main --workdir=runs/federico \\
        --config=experiments/configs/federico_fmnist.py:permuted_2
    # baselines: --config.algorithm=local / fedavg / fedavg_ft (same data and optimizer)
    # options: --config.federico.loss_scale=mean, --config.federico.accumulate=cumulative, ...
    # a quick CPU run: append ",small" (300 samples per client, 20 rounds)

The argument is "<scheme>_<G>[,small]", scheme one of SCHEMES, G in 2..4:
- groups_G: disjoint label sets per group, each group's K // G classes relabelled
  0..K//G-1 (partition="groups", group_relabel=True);
- permuted_G: IID partition with the labels permuted per group
  (partition="iid", permute_labels="group"): all clients see all classes and
  labels conflict across groups.
Client c is in group floor(c * G / 8). Data-scarce as in the paper: 900 samples per
client (about 10% of a client's ~8750-sample share), 80/20 train/test. The MLP
784-200-K and Adam (lr 1e-3, batch 32, one epoch of M-steps per round) for 50
rounds; FedeRiCo defaults n=3, epsilon=0.3, beta=0.6. The same study as
`python -m experiments.federico_study`.
"""

from __future__ import annotations

import ml_collections

from pfljax.experiment.configs import default

SCHEMES = ("groups", "permuted")
GROUPS = (2, 3, 4)


def get_config(arg: str = "permuted_2") -> ml_collections.ConfigDict:
    parts = [p for p in (arg or "permuted_2").split(",") if p]
    setting, small = parts[0], "small" in parts[1:]
    scheme, _, groups = setting.partition("_")
    if (
        scheme not in SCHEMES
        or groups not in {str(g) for g in GROUPS}
        or any(p != "small" for p in parts[1:])
    ):
        raise ValueError(
            f"config argument must be '<scheme>_<G>' with scheme in {SCHEMES} and G in {GROUPS}, "
            f"optionally with ',small'; got {arg!r}"
        )
    config = default.get_config()
    config.algorithm = "federico"
    config.dataset = "fashion_mnist"
    config.num_clients = 8
    config.num_groups = int(groups)
    if scheme == "groups":
        config.partition, config.group_relabel, config.permute_labels = "groups", True, "none"
    else:
        config.partition, config.permute_labels = "iid", "group"
    config.samples_per_client = 900
    config.test_fraction = 0.2
    config.rounds = 50
    config.local_steps = 0
    config.local_epochs = 1
    config.batch_size = 32
    config.optimizer = "adam"
    config.learning_rate = 1e-3
    config.momentum = 0.0
    config.model = "mlp"
    config.model_kwargs = ml_collections.ConfigDict({"hidden": (200,)})
    config.eval_every = 5
    if small:
        config.samples_per_client = 300
        config.rounds = 20
    return config
