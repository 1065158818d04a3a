"""LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated Learning with Local and
Global Representations", arXiv:2001.01523, 2020).

The first `local_layers` layers (the local representation) stay on each client;
the remaining (last) layers form the global model, trained with FedAvg. Only
the global layers are communicated. FedPer is the same mechanism with the last
layers local.

Paper vs code: the released code counts the other way, `num_layers_keep` =
number of last layers kept global (MNIST MLP: 3, CIFAR CNN: 2); here
`local_layers` = total layers - num_layers_keep, the number of first layers kept local.
The released code also starts LG-FedAvg from a FedAvg-trained model
(`--load_fed`); pass that model as `params_template` to `init` to do the same.
"""

from __future__ import annotations

from pfljax.algorithms import fedavg

build = fedavg.layers_local_builder("lg_fedavg", "first")
