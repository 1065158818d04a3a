"""FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021).

FedAvg in which every BatchNorm layer stays on the client: its parameters
(scale, bias) and its running statistics (batch_stats) are never averaged and
never sent. All other leaves are averaged as in FedAvg. BN layers are found
from the model's "batch_stats" collection, so any flax model with BatchNorm
works; `prepare_model` maps "cnn" to "cnn_bn" (BN after each conv) and "mlp" to
"mlp_bn" (BN after each hidden Dense layer, as in the paper's FC blocks).
"""

from __future__ import annotations

import re

import jax

from pfljax.algorithms import fedavg
from pfljax.core import params as P
from pfljax.core.clients import ClientMap
from pfljax.core.local import LocalTraining
from pfljax.core.types import Algorithm
from pfljax.models import build_model
from pfljax.models.base import Model

BN_VARIANTS = {"mlp": "mlp_bn", "cnn": "cnn_bn"}


def prepare_model(name: str, input_shape: tuple, num_outputs: int, **model_kwargs) -> Model:
    """The BN variant of a model name: "mlp" -> "mlp_bn", "cnn" -> "cnn_bn"; others as given."""
    return build_model(BN_VARIANTS.get(name, name), input_shape, num_outputs, **model_kwargs)


def bn_leaves(model: Model) -> tuple[str, ...]:
    """Regexes of every BatchNorm leaf: all "batch_stats" and the params of the same modules."""
    template = jax.eval_shape(model.init, jax.random.key(0))
    if not jax.tree.leaves(template.get("batch_stats", {})):
        raise ValueError(
            "fedbn needs a model with BatchNorm layers (a 'batch_stats' collection), e.g. model "
            "'cnn_bn' or fedbn.prepare_model('mlp' | 'cnn', ...)"
        )
    modules = sorted({path.rsplit("/", 1)[0] for path in P.leaf_paths(template["batch_stats"])})
    return ("^batch_stats/",) + tuple(rf"^params/{re.escape(m)}/" for m in modules)


def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    server_lr: float = 1.0,
    weighting: str = "samples",
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
        local_leaves=bn_leaves(model),
    )
