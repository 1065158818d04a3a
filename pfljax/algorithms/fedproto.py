"""FedProto (Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022).

No model parameters travel: each client keeps its own model (body f and linear
head g, PFLlib's BaseHeadSplit) and exchanges class prototypes, the mean feature
z = f(x) of each class. On each minibatch a participant takes one optimizer step on

    CE(g(z), y) + lam * MSE(z, P_y)

where P_y is the global prototype of the row's class (rows of a class without
one add 0; the MSE is the mean over the batch and the d feature entries, the
authors' and PFLlib's nn.MSELoss), and sums the features of the batch's real rows
per class (no gradient). Its local prototype of class j is the mean of those
features over the round's steps (the paper's Algorithm 1 and both codes compute
it inside the training loop: the model moves while they are collected). The
server sets P_j from the participants that saw class j; a class none of them has
keeps its previous prototype (none before it is first seen).

Options: `lam` (lambda, default 1: the paper's MNIST / FEMNIST value and PFLlib's
main.py -lam 1.0); `weighting` "samples" (the paper's Eq. 5: each client's prototype
weighted by its class count |D_ij|, i.e. the pooled mean of the participants'
class-j features) or "uniform" (the code's: plain mean over the participants
holding the class).

Evaluation: `accuracy` is the nearest global prototype (squared L2 distance of
the client's features to each P_j that exists; none yet: accuracy 0), what the
paper's inference rule and PFLlib report; `model_accuracy` and `loss` are the
client's own head g(f(x)).

Paper vs code: the paper's Eq. 5 is (1/|N_j|) sum_i (|D_ij| / N_j) C_ij; the
factor 1/|N_j| would shrink every prototype by the number of clients that hold
the class, so the default is the objective's weights |D_ij| / N_j, which sum to
one; the code's plain mean over clients is `weighting="uniform"`. A class no
participant of the round holds keeps its last prototype (`absent_classes="keep"`;
the paper does not say); PFLlib's server replaces the prototype set with the
round's aggregate, so such a class loses its prototype until a participant holds
it again: `absent_classes="drop"` (the same under PFLlib's full participation). The
authors' code collects the last local epoch's features, PFLlib's every epoch's (here
every step's: the same at PFLlib's 1 epoch). The optimizer is `local`'s (the authors':
SGD lr 0.01 momentum 0.5, batch 8; PFLlib's FMNIST protocol: SGD lr 0.005, batch 10).

Not implemented: the model-heterogeneous setting (every client trains the same
architecture here); prediction restricted to the client's own classes (the
authors' test routine).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.heads import apply_with_head, dense, feature_dim, features, linear_head
from pfljax.core.local import LocalTraining, epoch_orders, first_order, local_batch, run_steps
from pfljax.core.losses import Loss, get_loss, masked_mean
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model


class FedProtoState(NamedTuple):
    client_models: Any  # each client's own model, full variables [C, ...]
    global_protos: jax.Array  # [classes, d] the global prototype of each class
    global_mask: jax.Array  # [classes] bool: whether the class has one
    round: jax.Array


class ClassSums(NamedTuple):
    """What `make_class_sums_train` returns for one client."""

    params: Any  # the trained variables
    sums: jax.Array  # [classes, v] sum of the real rows' vectors per class, over all steps
    counts: jax.Array  # [classes] how many rows went into each class's sum
    loss: jax.Array  # mean objective over the active steps


def make_class_sums_train(local: LocalTraining, objective: Callable, num_classes: int, width: int):
    """Builds `train(variables, data, key, context) -> ClassSums` for ONE client: `local`'s
    optimizer and batch schedule (the rows of `make_local_train` for the same key), each
    step on `objective(params, rest, context, x, y, w) -> (loss, (updates, vectors [B, width]))`,
    the vectors of the step's real rows (weight 1) summed per class of y."""
    local = local.validate()
    optimizer = local.optimizer
    value_and_grad = jax.value_and_grad(objective, has_aux=True)

    def train(variables, data: ClientArrays, key, context) -> ClassSums:
        n_max = data.x.shape[0]
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        orders = epoch_orders(local, key, data.count, n_max)

        def step(carry, s):
            *state, order = carry
            params, rest, opt_state, sums, counts = state
            order, rows, w, active = local_batch(local, key, s, data.count, n_max, orders, order)
            xb, yb = data.x[rows], data.y[rows]
            (loss, (updates, vec)), grads = value_and_grad(params, rest, context, xb, yb, w)
            upd, new_opt = optimizer.update(grads, opt_state, params)
            new = (
                optax.apply_updates(params, upd),
                {**rest, **updates},
                new_opt,
                sums + jax.ops.segment_sum(vec * w[:, None], yb, num_classes),
                counts + jax.ops.segment_sum(w, yb, num_classes),
            )
            kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, tuple(state))
            return (*kept, order), loss, active

        sums0 = jnp.zeros((num_classes, width), jnp.float32)
        counts0 = jnp.zeros((num_classes,), jnp.float32)
        order0 = first_order(local, key, data.count, n_max, orders)
        init = (params, rest, optimizer.init(params), sums0, counts0, order0)
        (params, rest, _, sums, counts, _), mean_loss = run_steps(local, data.count, n_max, step, init)
        return ClassSums({**rest, "params": params}, sums, counts, mean_loss)

    return train


ABSENT_CLASSES = ("keep", "drop")


class FedProtoHyper(NamedTuple):
    """The local trainer, the server's weighting and what it does with absent classes."""

    train: Callable
    weighting: str
    absent_classes: str = "keep"


def proto_objective(model: Model, head: str, lam, params, rest, context, xb, yb, wb):
    """CE of the head's logits + lam * MSE(z, P_y) over the rows whose class has a
    global prototype (the mean over rows and feature entries); aux: (updates, z)."""
    protos, mask = context

    def head_fn(z):
        return dense(params[head], z), z

    (logits, z), updates = apply_with_head(model, head, {**rest, "params": params}, xb, True, head_fn)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
    reg = jnp.mean((z - protos[yb]) ** 2, axis=-1) * mask[yb]
    return masked_mean(ce + lam * reg, wb), (updates, jax.lax.stop_gradient(z))


def aggregate_prototypes(sums: jax.Array, counts: jax.Array, weighting: str):
    """(prototypes [classes, d], which classes any participant saw [classes]) from the
    participants' feature sums [K, classes, d] and counts [K, classes]: the pooled
    mean ("samples", Eq. 5) or the plain mean of the local means ("uniform", the code)."""
    holds = counts > 0
    if weighting == "samples":
        protos = jnp.sum(sums, 0) / jnp.maximum(jnp.sum(counts, 0), 1.0)[:, None]
    else:
        local = sums / jnp.maximum(counts, 1.0)[..., None]
        protos = jnp.sum(local * holds[..., None], 0) / jnp.maximum(jnp.sum(holds, 0), 1)[:, None]
    return protos, jnp.any(holds, 0)


def client_update(hp: FedProtoHyper, state: FedProtoState, cid, model_vars, data, key):
    """ONE client: its local schedule from its own model; returns (model, sums, counts)."""
    res = hp.train(model_vars, data, key, (state.global_protos, state.global_mask))
    return (res.params, res.sums, res.counts), res.loss


def server_update(hp: FedProtoHyper, state: FedProtoState, outputs, part: Participants):
    """The participants' models stored; each class seen this round gets its new prototype,
    the others keep theirs ("keep") or lose them ("drop")."""
    models, sums, counts = outputs
    protos, seen = aggregate_prototypes(sums, counts, hp.weighting)
    keep = hp.absent_classes == "keep"
    mask = state.global_mask | seen if keep else seen
    return state._replace(
        client_models=part.scatter(state.client_models, models),
        global_protos=jnp.where(seen[:, None], protos, state.global_protos if keep else 0.0),
        global_mask=mask,
    ), {"prototype_classes": jnp.sum(mask).astype(jnp.float32)}


def init(model: Model, head: str, key, params_template=None, num_clients: int = 1) -> FedProtoState:
    """Every client starts from the same model (PFLlib copies one); no prototypes yet."""
    params = model.initial(key, params_template)
    k, d = model.num_outputs, feature_dim(model, head)
    return FedProtoState(
        broadcast(params, num_clients),
        jnp.zeros((k, d), jnp.float32),
        jnp.zeros((k,), bool),
        jnp.zeros([], jnp.int32),
    )


def nearest_scores(model: Model, head: str, variables: dict, x: jax.Array, train: bool = False):
    """Minus the squared distance [B, classes] of the features to each global prototype
    (-inf for a class without one); `variables` {"model", "protos", "mask"}."""
    z, _ = features(model, head, variables["model"], x, False)
    d2 = jnp.sum((z[:, None, :] - variables["protos"][None]) ** 2, axis=-1)
    return jnp.where(variables["mask"][None], -d2, -jnp.inf), None


def _nearest_correct(scores, y):
    """1 where the nearest prototype is y's (0 while no class has a prototype)."""
    hit = (jnp.argmax(scores, -1) == y) & jnp.isfinite(jnp.max(scores, -1))
    return hit.astype(jnp.float32)


NEAREST = Loss("fedproto_nearest", lambda scores, y: jnp.zeros(y.shape, jnp.float32), _nearest_correct)


def evaluate(model: Model, head: str, client_map, state: FedProtoState, data: ClientData, key):
    """`accuracy`: nearest global prototype (PFLlib's); `model_accuracy`, `loss`: the own head."""
    own = evaluate_clients(model.apply, lambda c: take(state.client_models, c), data.test, client_map)

    def variables_of(c):
        model_vars = take(state.client_models, c)
        return {"model": model_vars, "protos": state.global_protos, "mask": state.global_mask}

    nearest = functools.partial(nearest_scores, model, head)
    proto = evaluate_clients(nearest, variables_of, data.test, client_map, NEAREST)
    return {**own, "accuracy": proto["accuracy"], "model_accuracy": own["accuracy"]}


DOMAINS = {"lam": Domain(0, note="0: no prototype term, each client trains alone")}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    lam: float = 1.0,
    weighting: str = "samples",
    absent_classes: str = "keep",
) -> Algorithm:
    """FedProto: personal models regularized towards global class prototypes.

    Args:
      lam: weight lambda of the prototype term (>= 0).
      weighting: the server's mean of a class's prototypes: "samples" (by class count,
        the paper's) or "uniform" (plain mean over the clients holding it, the code's);
        also the weights of the reported train loss.
      absent_classes: a class no participant of the round holds "keep"s its last prototype
        or "drop"s it (PFLlib's code).
      Others: as fedavg.build. Classification only (`local.loss` "cross_entropy");
      the model's last layer must be one Dense.
    """
    check_weighting(weighting)
    if absent_classes not in ABSENT_CLASSES:
        raise ValueError(f"absent_classes must be one of {ABSENT_CLASSES}, got {absent_classes!r}")
    local = local.validate()
    if get_loss(local.loss).name != "cross_entropy":
        raise ValueError(f"FedProto needs local.loss 'cross_entropy', got {get_loss(local.loss).name!r}")
    cmap = as_client_map(client_map)
    head = linear_head(model, "FedProto")
    objective = functools.partial(proto_objective, model, head, lam)
    k, d = model.num_outputs, feature_dim(model, head)
    hp = FedProtoHyper(make_class_sums_train(local, objective, k, d), weighting, absent_classes)
    step = client_step(
        functools.partial(client_update, hp), functools.partial(server_update, hp), cmap, "client_models"
    )
    return Algorithm(
        functools.partial(init, model, head),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            bytes_up=4.0 * k * (d + 1),  # prototypes and their class counts
            bytes_down=4.0 * k * d,
        ),
        functools.partial(evaluate, model, head, cmap),
    )
