"""pFedPara (Hyeon-Woo et al., "FedPara: Low-Rank Hadamard Product for Communication-Efficient
Federated Learning", ICLR 2022, Sec. 3.3).

Every layer's weight is W = W1 o (W2 + 1) with W1 = X1 Y1^T and W2 = X2 Y2^T
low-rank (`pfljax.models.lowrank`): the first pair (X1, Y1) is global,
averaged with FedAvg; the second pair (X2, Y2) is personal, never sent. So a
round sends about half of an already compressed model. The form
W = W1 o W2 (model kwarg `form="fedpara"`, the issue's wording) is an option.

Paper vs code: the paper names only the two pairs; biases are global here
(`local_bias=True` keeps them personal, as the Flower reimplementation in
effect does). The rank is a model option: `rank_ratio` (default 0.5, the
Flower pFedPara MNIST config) or a fixed `rank`, passed through the model kwargs
of `prepare_model`.
"""

from __future__ import annotations

import jax

from pfljax.algorithms import fedavg
from pfljax.core import params as P
from pfljax.core.clients import ClientMap
from pfljax.core.local import LocalTraining
from pfljax.core.types import Algorithm
from pfljax.models.base import Model, from_flax
from pfljax.models.lowrank import LowRankCNN, LowRankMLP

LOWRANK_MODELS = {"mlp": LowRankMLP, "cnn": LowRankCNN}
PERSONAL_FACTORS = r"/[xyt]2$"


def prepare_model(name: str, input_shape: tuple, num_outputs: int, **model_kwargs) -> Model:
    """The low-rank Hadamard variant of "mlp" or "cnn" (kwargs: the model's plus
    rank_ratio, rank, form)."""
    if name not in LOWRANK_MODELS:
        raise ValueError(f"pfedpara model must be one of {sorted(LOWRANK_MODELS)}, got {name!r}")
    module = LOWRANK_MODELS[name](num_outputs=num_outputs, **model_kwargs)
    return from_flax(module, tuple(input_shape), num_outputs)


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    local_bias: bool = False,
    server_lr: float = 1.0,
    weighting: str = "samples",
) -> Algorithm:
    """pFedPara: FedAvg on the first low-rank pair (and biases), the second pair personal.

    Args:
      model: a low-rank Hadamard model (`prepare_model`); ValueError otherwise.
      local_bias: keep biases personal too.
      Others: as fedavg.build.
    """
    template = jax.eval_shape(model.init, jax.random.key(0))
    if not any(jax.tree.leaves(P.match_paths(template, [PERSONAL_FACTORS]))):
        raise ValueError(
            "pfedpara needs a low-rank Hadamard model (leaves x2/y2); build it with pfedpara.prepare_model"
        )
    local_leaves = (PERSONAL_FACTORS,) + ((r"/bias$",) if local_bias else ())
    return fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        server_lr=server_lr,
        weighting=weighting,
        local_leaves=local_leaves,
    )
