"""FedAvg+ : FedAvg, then each client fine-tunes the global model before evaluation.

As in the pFedLA paper's "FedAvg+" baseline (and Per-FedAvg's evaluation
protocol): training is plain FedAvg; `evaluate` first fine-tunes on the client's
own train rows (`finetune_epochs` local epochs, or `finetune_steps` steps), then
tests the fine-tuned model. Client c's fine-tuning key is fold_in(evaluation
key, c), so evaluation is deterministic given its key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import optax

from pfljax.algorithms import fedavg
from pfljax.core.clients import ClientMap, as_client_map, take
from pfljax.core.domains import SERVER_LR, Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.privacy import ClientDP
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model


def finetune_spec(local: LocalTraining, epochs: int, steps: int, batch_size: int, lr: float) -> LocalTraining:
    """The fine-tuning schedule: `local` with `steps` steps (> 0) or `epochs` epochs,
    batch size `batch_size` (0: local's) and plain SGD of rate `lr` (0: local's optimizer)."""
    return local._replace(
        optimizer=optax.sgd(lr) if lr else local.optimizer,
        batch_size=batch_size or local.batch_size,
        steps=steps or None,
        epochs=None if steps else epochs,
    ).validate()


def evaluate(
    model: Model, client_map, loss, tune: Callable, state: fedavg.FedAvgState, data: ClientData, key
):
    """Client c fine-tunes its FedAvg model (key fold_in(key, its client id)), then tests."""

    def tuned(c):
        start = fedavg.personalized(state, c)
        return tune(start, take(data.train, c), jax.random.fold_in(key, data.client_id(c))).params

    return evaluate_clients(model.apply, tuned, data.test, client_map, loss)


DOMAINS = {
    "finetune_epochs": Domain(1, integer=True),
    "finetune_steps": Domain(0, integer=True, note="0: use finetune_epochs"),
    "finetune_batch_size": Domain(0, integer=True, note="0: local's"),
    "finetune_lr": Domain(0, note="0: the local optimizer"),
    "server_lr": SERVER_LR,
    "prox_mu": fedavg.DOMAINS["prox_mu"],
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    finetune_epochs: int = 1,
    finetune_steps: int = 0,
    finetune_batch_size: int = 0,
    finetune_lr: float = 0.0,
    server_lr: float = 1.0,
    prox_mu: float = 0.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
) -> Algorithm:
    """FedAvg+: FedAvg, fine-tuned before each evaluation.

    Args:
      finetune_epochs: local epochs of fine-tuning (unless finetune_steps > 0).
      finetune_steps: fine-tuning steps instead of epochs (0: use epochs).
      finetune_batch_size: fine-tuning batch size (0: `local.batch_size`).
      finetune_lr: fine-tune with plain SGD of this rate (0: `local.optimizer`).
      Others: as fedavg.build. The loss is `local.loss`.
    """
    base = fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        server_lr=server_lr,
        prox_mu=prox_mu,
        weighting=weighting,
        privacy=privacy,
        server_optimizer=server_optimizer,
    )
    spec = finetune_spec(local, finetune_epochs, finetune_steps, finetune_batch_size, finetune_lr)
    tune = make_local_train(model.apply, spec)
    return Algorithm(
        base.init, base.round, functools.partial(evaluate, model, as_client_map(client_map), local.loss, tune)
    )
