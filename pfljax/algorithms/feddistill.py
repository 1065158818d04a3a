"""FD, federated distillation (Jeong et al., "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data", NeurIPS Workshop 2018).

No model parameters travel: each client keeps its own model and exchanges one
output vector per label, the mean of its model's outputs over its training rows
of that label (PFLlib's FedDistill, "FD"). On each minibatch a participant takes
one optimizer step on

    CE(F(x), y) + gamma * H(T_y, F(x))

where F(x) is the softmax output, T_y the teacher vector of the row's label and
H(p, q) = -sum_k p_k log q_k (rows whose label has no teacher add 0), and adds
F(x) of the batch's real rows (no gradient) to its per-label sums; the means over
the round's steps are its upload. The teacher of client i is the mean of the
uploads of the last round's other participants that hold the label (the paper's
sum_{j != i} F_j / (M - 1)). Evaluation: each client's own model.

Options: `gamma` (the distillation weight; the paper gives no value: PFLlib's
main.py -lam 1.0); `teacher` "others" (the paper's: a client's own upload left
out) or "all" (PFLlib's: the mean over every participant holding the label);
`outputs` "softmax" (the paper's: softmax outputs averaged, the cross-entropy
H above) or "logits" (PFLlib's: raw logits averaged, and torch's CrossEntropyLoss
with those averaged logits as soft targets, -sum_k T_yk log softmax(z)_k; a row
whose label has no teacher then targets its own detached logits, once any table
was received, as PFLlib's clientfd does).

Paper vs code: the two options above (PFLlib = teacher="all", outputs="logits").
The code's raw-logit targets have negative entries, so its distillation term is
unbounded below: on the tests' toy data it reached NaN within 20 rounds at SGD lr
0.005 (the default stayed finite over 200 rounds at lr 0.005 and 0.1).
State: each client's model [C, ...]; the last round's participants' ids and
per-label means and counts [K, ...] (so a client's teacher can leave its own
upload out); the round reads and writes only its participants' rows.

Not implemented: FAug (the paper's GAN-based augmentation); the future-work
weighting of later logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.algorithms.fedproto import make_class_sums_train
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.sampling import check_clients_per_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

TEACHERS = ("others", "all")
OUTPUTS = ("softmax", "logits")


class FedDistillState(NamedTuple):
    client_models: Any  # each client's own model, full variables [C, ...]
    last_ids: jax.Array  # [K] client ids of the last round's participants (-1: none yet)
    last_means: jax.Array  # [K, classes, classes] their per-label mean outputs
    last_counts: jax.Array  # [K, classes] their rows per label (0: label not held)
    round: jax.Array


class FedDistillHyper(NamedTuple):
    """The local trainer and the teacher rule."""

    train: Callable
    teacher: str


def teacher_table(state: FedDistillState, client_id: jax.Array, teacher: str):
    """(teacher vectors [classes, classes], which labels have one [classes]) of one client:
    the mean of the last participants' per-label means over those holding the label
    (leaving the client's own out with teacher="others")."""
    holds = state.last_counts > 0
    if teacher == "others":
        holds = holds & (state.last_ids != client_id)[:, None]
    n = jnp.sum(holds, 0)
    table = jnp.sum(state.last_means * holds[..., None], 0) / jnp.maximum(n, 1)[:, None]
    return table, n > 0


def distill_objective(apply_fn, gamma, outputs: str, params, rest, context, xb, yb, wb):
    """CE(F(x), y) + gamma * the distillation term; aux: (updates, the vectors averaged)."""
    table, has, received = context
    logits, updates = apply_fn({**rest, "params": params}, xb, train=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
    log_probs = jax.nn.log_softmax(logits)
    if outputs == "softmax":
        target, on, vec = table[yb], has[yb], jax.nn.softmax(logits)
    else:  # PFLlib: raw logits as soft targets; rows without a teacher target their own
        target = jnp.where(has[yb][:, None], table[yb], jax.lax.stop_gradient(logits))
        on, vec = jnp.broadcast_to(received, yb.shape), logits
    distill = -jnp.sum(target * log_probs, axis=-1) * on
    return masked_mean(ce + gamma * distill, wb), (updates, jax.lax.stop_gradient(vec))


def participant_ids(state: FedDistillState, part: Participants) -> tuple[Any, jax.Array]:
    """Each participant's model and client id (a view's rows carry their ids)."""
    ids = part.ids if part.client_ids is None else part.client_ids
    return part.gather(state.client_models), ids


def client_update(hp: FedDistillHyper, state: FedDistillState, cid, inputs, data, key):
    """ONE client: its local schedule towards its teacher; returns (model, sums, counts)."""
    model_vars, client_id = inputs
    table, has = teacher_table(state, client_id, hp.teacher)
    res = hp.train(model_vars, data, key, (table, has, state.round > 0))
    return (res.params, res.sums, res.counts), res.loss


def server_update(state: FedDistillState, outputs, part: Participants):
    """The participants' models stored; their per-label means kept for the next round."""
    models, sums, counts = outputs
    return state._replace(
        client_models=part.scatter(state.client_models, models),
        last_ids=part.ids if part.client_ids is None else part.client_ids,
        last_means=sums / jnp.maximum(counts, 1.0)[..., None],
        last_counts=counts,
    ), {}


def init(model: Model, clients_per_round, key, params_template=None, num_clients: int = 1):
    """Every client starts from the same model (PFLlib copies one); no uploads yet."""
    params = model.initial(key, params_template)
    k, n = check_clients_per_round(clients_per_round, num_clients), model.num_outputs
    return FedDistillState(
        broadcast(params, num_clients),
        jnp.full((k,), -1, jnp.int32),
        jnp.zeros((k, n, n), jnp.float32),
        jnp.zeros((k, n), jnp.float32),
        jnp.zeros([], jnp.int32),
    )


def evaluate(model: Model, client_map, state: FedDistillState, data: ClientData, key):
    """Each client's own model on its test rows."""
    return evaluate_clients(model.apply, lambda c: take(state.client_models, c), data.test, client_map)


DOMAINS = {"gamma": Domain(0, note="0: no distillation, each client trains alone")}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    gamma: float = 1.0,
    teacher: str = "others",
    outputs: str = "softmax",
    weighting: str = "samples",
) -> Algorithm:
    """FD: personal models distilled towards per-label mean outputs of the other clients.

    Args:
      gamma: weight of the distillation regularizer (>= 0).
      teacher: "others" (the paper's: the other participants' mean) or "all" (PFLlib's).
      outputs: "softmax" (the paper's) or "logits" (PFLlib's raw logits, see module doc).
      weighting: weights of the reported train loss ("samples" or "uniform"); the
        per-label means are plain means over clients (paper and code).
      Others: as fedavg.build. Classification only (`local.loss` "cross_entropy").
    """
    check_weighting(weighting)
    if teacher not in TEACHERS:
        raise ValueError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
    local = local.validate()
    if get_loss(local.loss).name != "cross_entropy":
        raise ValueError(f"FD needs local.loss 'cross_entropy', got {get_loss(local.loss).name!r}")
    cmap = as_client_map(client_map)
    n = model.num_outputs
    objective = functools.partial(distill_objective, model.apply, gamma, outputs)
    hp = FedDistillHyper(make_class_sums_train(local, objective, n, n), teacher)
    step = client_step(functools.partial(client_update, hp), server_update, cmap, participant_ids)
    return Algorithm(
        functools.partial(init, model, clients_per_round),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            bytes_up=4.0 * n * (n + 1),  # per-label means and their counts
            bytes_down=4.0 * n * n,
        ),
        functools.partial(evaluate, model, cmap),
    )
