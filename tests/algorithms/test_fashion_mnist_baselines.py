"""Small Fashion-MNIST run (10 clients, 4 classes each): FedAvg+ beats FedAvg on the
clients' own test sets, and Local, FedAvg and FedAvg+ are all far above chance (1/4
within a client's classes)."""

import os

import jax
import optax
import pytest

from pfljax.algorithms import fedavg, fedavg_ft, local
from pfljax.core.evaluate import summarize
from pfljax.core.local import LocalTraining
from pfljax.data import build_federated_data
from pfljax.models import build_model

IDX_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isdir(IDX_DIR), reason="Debian package dataset-fashion-mnist not installed")
def test_fedavg_plus_beats_fedavg_and_all_beat_chance():
    fd = build_federated_data(
        "fashion_mnist", 10, partition="classes", classes_per_client=4, samples_per_client=300, seed=0
    )
    model = build_model("mlp", fd.input_shape, fd.num_classes, hidden=(200,))
    spec = LocalTraining(optax.sgd(0.05, momentum=0.9), batch_size=32, epochs=1, steps=None)
    acc = {}
    for name, mod in [("local", local), ("fedavg", fedavg), ("fedavg_ft", fedavg_ft)]:
        alg = mod.build(model, spec)
        state = alg.init(jax.random.key(0), None, 10)
        rnd = jax.jit(alg.round)
        for _ in range(10):
            state, _ = rnd(state, fd.data, jax.random.key(1))
        acc[name] = summarize(jax.device_get(jax.jit(alg.evaluate)(state, fd.data, jax.random.key(3))))[
            "mean_accuracy"
        ]
    print(acc)
    assert acc["fedavg_ft"] > acc["fedavg"] + 0.05, acc
    assert min(acc.values()) > 0.5, acc
