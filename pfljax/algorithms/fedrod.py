"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022).

The model's last layer (a Dense: kernel and bias) is the generic head g, shared
with the body f and averaged with it (FedAvg, weighted by train size); each
client adds a personal head p of the same shape, kept local. On each minibatch
a client takes one optimizer step on
- the balanced softmax loss of g(f(x)): cross-entropy of the logits plus the log
  of its own class counts n_y (Ren et al., 2020), for the body and g;
- the cross-entropy of g(z) + p(z), z = f(x), with the body and g held fixed
  (stop-gradient), for p: the personal head learns on top of the generic one.
Prediction (evaluation) is g(z) + p(z); `generic_accuracy` is the generic model's.

Construction: both heads are linear in z, so g(z) + p(z) is the user's model
with its head's kernel and bias replaced by the sums; a personal forward pass
with the body's parameters behind stop_gradient gives p's gradient. Hence any
model whose last layer is one Dense works (mlp, cnn, resnet9).

Paper vs code (PFLlib's clientrod, which follows the paper): the personal head
starts as a copy of the initial generic head (the code's deepcopy; the paper
does not say), and its step uses the same optimizer settings. The paper's
hypernetwork variant of p (FedRoD-hyper) is not implemented.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.heads import linear_head
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.losses import Loss, get_loss
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

PERSONAL = "fedrod_personal_head"  # the personal head's entry in the trained "params"
PRIOR = "fedrod_log_prior"  # the collection holding the client's log class counts
ABSENT = -1e9  # log count of a class the client does not have (exp underflows to 0)


class FedRoDState(NamedTuple):
    global_params: Any  # body + generic head (full variables)
    client_heads: Any  # personal heads p_i ({"kernel", "bias"} [C, ...])
    round: jax.Array


class FedRoDHyper(NamedTuple):
    """The local trainer of both losses, the head's name and the number of classes."""

    train: Callable
    head: str
    num_classes: int


def log_class_counts(y: jax.Array, count: jax.Array, num_classes: int) -> jax.Array:
    """log n_c [classes] over the real rows of one client (ABSENT for n_c = 0)."""
    valid = (jnp.arange(y.shape[0]) < count).astype(jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(y, num_classes) * valid[:, None], axis=0)
    return jnp.where(counts > 0, jnp.log(jnp.maximum(counts, 1.0)), ABSENT)


def balanced_softmax_loss(logits: jax.Array, y: jax.Array, log_counts: jax.Array) -> jax.Array:
    """Per-example balanced softmax loss -log(n_y e^{l_y} / sum_j n_j e^{l_j}) [B]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits + log_counts[None], y)


def with_head(params: dict, head: str, extra: dict) -> dict:
    """`params` with the head's leaves plus those of `extra` (g + p for linear heads)."""
    return {**params, head: jax.tree.map(jnp.add, params[head], extra)}


def rod_apply(apply_fn, head: str, variables: dict, x: jax.Array, train: bool = False):
    """FedRoD's two outputs [B, 2, classes]: generic logits + log class counts (the
    balanced softmax), and g(z) + p(z) with the body and g behind stop_gradient."""
    params = dict(variables["params"])
    personal = params.pop(PERSONAL)
    rest = {k: v for k, v in variables.items() if k not in ("params", PRIOR)}
    generic, updates = apply_fn({**rest, "params": params}, x, train=train)
    fixed = with_head(jax.lax.stop_gradient(params), head, personal)
    summed, _ = apply_fn({**rest, "params": fixed}, x, train=train)
    return jnp.stack([generic + variables[PRIOR]["log_counts"][None], summed], axis=1), updates


def _rod_per_example(out, y):
    ce = optax.softmax_cross_entropy_with_integer_labels
    return ce(out[:, 0], y) + ce(out[:, 1], y)


# The balanced softmax loss of g plus the cross-entropy of g + p (gradients apart).
ROD_LOSS = Loss(
    "fedrod", _rod_per_example, lambda out, y: (jnp.argmax(out[:, 1], -1) == y).astype(jnp.float32)
)


def personalized(state: FedRoDState, head: str, c: jax.Array) -> Any:
    """Client c's predictor g + p as one model: the head's parameters summed."""
    g = state.global_params
    return {**g, "params": with_head(g["params"], head, take(state.client_heads, c))}


def client_update(hp: FedRoDHyper, state: FedRoDState, cid, personal, data, key):
    """ONE client: the local schedule on both losses; returns (body + g, p)."""
    g = state.global_params
    prior = {"log_counts": log_class_counts(data.y, data.count, hp.num_classes)}
    start = {**g, "params": {**g["params"], PERSONAL: personal}, PRIOR: prior}
    res = hp.train(start, data, key)
    params = dict(res.params["params"])
    personal = params.pop(PERSONAL)
    trained = {k: v for k, v in res.params.items() if k != PRIOR}
    return ({**trained, "params": params}, personal), res.loss


def server_update(state: FedRoDState, outputs, part: Participants):
    """Body and generic head: the weighted mean; personal heads stored."""
    trained, personal = outputs
    average, metrics = part.average(trained, state.global_params)
    return state._replace(
        global_params=average, client_heads=part.scatter(state.client_heads, personal)
    ), metrics


def init(model: Model, head: str, key, params_template=None, num_clients: int = 1) -> FedRoDState:
    params = model.initial(key, params_template)
    return FedRoDState(params, broadcast(params["params"][head], num_clients), jnp.zeros([], jnp.int32))


def evaluate(model: Model, client_map, head: str, state: FedRoDState, data: ClientData, key):
    """Each client's g + p on its test rows; `generic_accuracy`: g alone."""
    scores = evaluate_clients(model.apply, lambda c: personalized(state, head, c), data.test, client_map)
    generic = evaluate_clients(model.apply, lambda c: state.global_params, data.test, client_map)
    return {**scores, "generic_accuracy": generic["accuracy"]}


@checked({})
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    weighting: str = "samples",
    privacy: ClientDP | None = None,
) -> Algorithm:
    """FedRoD with a linear personal head.

    Args: as fedavg.build; `local` sets the optimizer and schedule of both heads'
    steps. Classification only (`local.loss` "cross_entropy").
    """
    check_weighting(weighting)
    local = local.validate()
    if get_loss(local.loss).name != "cross_entropy":
        raise ValueError(f"FedRoD needs local.loss 'cross_entropy', got {get_loss(local.loss).name!r}")
    cmap = as_client_map(client_map)
    head = linear_head(model, "FedRoD")
    train = make_local_train(functools.partial(rod_apply, model.apply, head), local._replace(loss=ROD_LOSS))
    hp = FedRoDHyper(train, head, model.num_outputs)
    step = client_step(functools.partial(client_update, hp), server_update, cmap, "client_heads")
    model_bytes = P.tree_bytes(model.template())
    return Algorithm(
        functools.partial(init, model, head),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=model_bytes,
            bytes_down=model_bytes,
        ),
        functools.partial(evaluate, model, cmap, head),
    )
