"""FedAvg+ : FedAvg, then each client fine-tunes the global model before evaluation.

As in the pFedLA paper's "FedAvg+" baseline (and Per-FedAvg's evaluation
protocol): training is plain FedAvg; `evaluate` first runs `finetune_epochs`
local epochs on the client's own train rows, then tests the fine-tuned model.
The fine-tuning key is fixed per (round, client), so evaluation is deterministic.
"""

from __future__ import annotations

import jax

from pfljax.algorithms import fedavg
from pfljax.core.clients import ClientMap, as_client_map, take
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    finetune_epochs: int = 1,
    server_lr: float = 1.0,
    prox_mu: float = 0.0,
    weighting: str = "samples",
    finetune: LocalTraining | None = None,
) -> Algorithm:
    """FedAvg+ with `finetune_epochs` local epochs before each evaluation.

    Args:
      finetune: local training used for fine-tuning (default: `local` with
        epochs=finetune_epochs).
      Others: as fedavg.build.
    """
    if finetune_epochs < 1:
        raise ValueError(f"finetune_epochs must be >= 1, got {finetune_epochs}")
    base = fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        server_lr=server_lr,
        prox_mu=prox_mu,
        weighting=weighting,
    )
    spec = finetune or local._replace(steps=None, epochs=finetune_epochs)
    tune = make_local_train(model.apply, spec)
    cmap = as_client_map(client_map)

    def evaluate(state: fedavg.FedAvgState, data: ClientData):
        key = jax.random.fold_in(jax.random.key(0x5EED), state.round)

        def tuned(c):
            start = fedavg.personalized(state, c)
            return tune(start, take(data.train, c), jax.random.fold_in(key, c)).params

        return evaluate_clients(model.apply, tuned, data.test, cmap, local.loss)

    return Algorithm(base.init, base.round, evaluate)
