"""pFedPara (Hyeon-Woo et al., "FedPara: Low-Rank Hadamard Product for Communication-Efficient
Federated Learning", ICLR 2022, Sec. 3.3).

Every layer's weight is W = W1 o (W2 + 1) with W1 = X1 Y1^T and W2 = X2 Y2^T
low-rank (`pfljax.models.lowrank`): the first pair (X1, Y1) is global,
averaged with FedAvg; the second pair (X2, Y2) is personal, never sent. So a
round sends about half of an already compressed model. The form
W = W1 o W2 (model kwarg `form="fedpara"`) is an option.

Paper vs code: the paper names only the two pairs; biases are global here
(`local_bias=True` keeps them personal, as the Flower reimplementation in
effect does). The rank is a model option: `rank_ratio` (default 0.5, the
Flower pFedPara MNIST config) or a fixed `rank`, passed through the model kwargs.

Models: `MODEL_VARIANTS` maps "mlp" / "cnn" to their low-rank versions
"lowrank_mlp" / "lowrank_cnn" (pfljax.models registry).
"""

from __future__ import annotations

import jax
import optax

from pfljax.algorithms import fedavg
from pfljax.core import params as P
from pfljax.core.clients import ClientMap
from pfljax.core.domains import SERVER_LR, checked
from pfljax.core.local import LocalTraining
from pfljax.core.privacy import ClientDP
from pfljax.core.types import Algorithm
from pfljax.models.base import Model

MODEL_VARIANTS = {
    "mlp": "lowrank_mlp",
    "cnn": "lowrank_cnn",
    "lowrank_mlp": "lowrank_mlp",
    "lowrank_cnn": "lowrank_cnn",
}
PERSONAL_FACTORS = r"/[xyt]2$"


DOMAINS = {"server_lr": SERVER_LR}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    local_bias: bool = False,
    server_lr: float = 1.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
) -> Algorithm:
    """pFedPara: FedAvg on the first low-rank pair (and biases), the second pair personal.

    Args:
      model: a low-rank Hadamard model ("lowrank_mlp", "lowrank_cnn"); ValueError otherwise.
      local_bias: keep biases personal too.
      Others: as fedavg.build.
    """
    template = model.template()
    if not any(jax.tree.leaves(P.match_paths(template, [PERSONAL_FACTORS]))):
        raise ValueError(
            "pfedpara needs a low-rank Hadamard model (leaves x2/y2): model 'lowrank_mlp' or 'lowrank_cnn'"
        )
    local_leaves = (PERSONAL_FACTORS,) + ((r"/bias$",) if local_bias else ())
    return fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        server_lr=server_lr,
        weighting=weighting,
        privacy=privacy,
        server_optimizer=server_optimizer,
        local_leaves=local_leaves,
    )
