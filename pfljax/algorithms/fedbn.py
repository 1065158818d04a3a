"""FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021).

FedAvg in which every BatchNorm layer stays on the client: its parameters
(scale, bias) and its running statistics (batch_stats) are never averaged and
never sent. All other leaves are averaged as in FedAvg. BN layers are found
from the model's "batch_stats" collection, so any flax model with BatchNorm
works; `MODEL_VARIANTS` maps "cnn" to "cnn_bn" (BN after each conv) and "mlp" to
"mlp_bn" (BN after each hidden Dense layer, as in the paper's FC blocks).
"""

from __future__ import annotations

import re

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

# The models with BatchNorm that FedBN trains for each model name it accepts.
MODEL_VARIANTS = {
    "mlp": "mlp_bn",
    "cnn": "cnn_bn",
    "mlp_bn": "mlp_bn",
    "cnn_bn": "cnn_bn",
    "resnet9": "resnet9",
    "factorized_cnn_bn": "factorized_cnn_bn",
    "factorized_resnet9": "factorized_resnet9",
}


def bn_leaves(model: Model) -> tuple[str, ...]:
    """Regexes of every BatchNorm leaf: all "batch_stats" and the params of the same modules."""
    template = model.template()
    if not jax.tree.leaves(template.get("batch_stats", {})):
        raise ValueError(
            "fedbn needs a model with BatchNorm layers (a 'batch_stats' collection), e.g. model "
            f"'cnn_bn' (the models fedbn trains: {sorted(set(MODEL_VARIANTS.values()))})"
        )
    modules = sorted({path.rsplit("/", 1)[0] for path in P.leaf_paths(template["batch_stats"])})
    return ("^batch_stats/",) + tuple(rf"^params/{re.escape(m)}/" for m in modules)


DOMAINS = {"server_lr": SERVER_LR}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    server_lr: float = 1.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
    server_optimizer: optax.GradientTransformation | None = None,
) -> Algorithm:
    """FedBN: FedAvg with BatchNorm parameters and statistics local.

    Args: as fedavg.build. Raises ValueError if the model has no BatchNorm.
    """
    return fedavg.build(
        model,
        local,
        clients_per_round=clients_per_round,
        client_map=client_map,
        server_lr=server_lr,
        weighting=weighting,
        privacy=privacy,
        server_optimizer=server_optimizer,
        local_leaves=bn_leaves(model),
    )
