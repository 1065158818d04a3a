"""pFedMe (T. Dinh et al., "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020).

Each client keeps a personalized model theta_i near its copy w_i of the global
model. One local step (R per round) draws a minibatch D and
1. approximately solves theta = argmin f(theta; D) + lam / 2 ||theta - w||^2 with
   `inner_steps` (K) gradient steps of size `personal_lr`, warm-started from
   the previous theta (theta = w at the start of a round, as in the authors' code);
2. moves w along the Moreau-envelope gradient lam * (w - theta) with
   `local.optimizer` (plain SGD of rate eta gives the paper's w <- w - eta lam (w - theta)).
The server mixes w <- (1 - beta) w + beta * mean of the sampled clients' w_i.
Evaluation uses each client's theta_i.

Paper vs code: the paper's Algorithm 1 has every client train each round and
only the sampled ones send (`train_all=True`, the default; False trains only
the sampled clients); the server mean is uniform (`weighting="samples"`
weights by train size as the code does); the code's inner optimizer adds an L2
term mu * theta (mu = 0.001, here `personal_l2`, default 0 as in the paper).
Defaults lam=15, K=5, personal_lr=0.1, beta=1 are the authors' MNIST command
(with eta = 0.005, batch 20, R = 20 local steps).

Schedule: `local.steps` = R; with `local.epochs` = E, R = E * ceil(n / B)
(one minibatch per local step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.algorithms import refused_when
from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked, known_zero
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, epoch_orders, run_steps, step_batch
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.round import Participants, check_weighting, federated_round, map_clients
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model


class PFedMeState(NamedTuple):
    global_params: Any  # w (full variables)
    client_personal: Any  # theta_i, full variables [C, ...]
    round: jax.Array


class PFedMeHyper(NamedTuple):
    """The Moreau-envelope trainer, the server mixing weight beta, whether every
    client trains, and the bytes of one model."""

    train: Callable
    beta: float
    train_all: bool
    model_bytes: float


def make_inner_grad(apply_fn, loss, lam, personal_l2):
    """grad of f(theta; D) + lam / 2 ||theta - w||^2 (+ personal_l2 / 2 ||theta||^2)
    w.r.t. theta, with aux (loss, collection updates)."""
    loss_obj = get_loss(loss)

    def inner_objective(theta, rest, w, xb, yb, wb):
        out, updates = apply_fn({**rest, "params": theta}, xb, train=True)
        loss = masked_mean(loss_obj.per_example(out, yb), wb)
        sq = sum(jnp.sum((t - a) ** 2) for t, a in zip(jax.tree.leaves(theta), jax.tree.leaves(w)))
        total = loss + 0.5 * lam * sq
        if not known_zero(personal_l2):
            total = total + 0.5 * personal_l2 * sum(jnp.sum(t**2) for t in jax.tree.leaves(theta))
        return total, (loss, updates)

    return jax.grad(inner_objective, has_aux=True)


def make_moreau_train(apply_fn, local: LocalTraining, lam, inner_steps, personal_lr, personal_l2):
    """train(w, data, key) -> ((w_new, theta), mean personal loss) for ONE client (variables dicts)."""
    inner_grad = make_inner_grad(apply_fn, local.loss, lam, personal_l2)
    optimizer = local.optimizer

    def train(variables, data: ClientArrays, key):
        n_max = data.x.shape[0]
        orders = epoch_orders(local, key, data.count, n_max)

        def step(carry, s):
            w, theta, rest, opt_state = carry
            rows, wb, active = step_batch(local, key, s, data.count, n_max, orders)
            xb, yb = data.x[rows], data.y[rows]

            def inner(c, _):
                theta, rest = c
                g, (loss, updates) = inner_grad(theta, rest, w, xb, yb, wb)
                return (jax.tree.map(lambda t, gi: t - personal_lr * gi, theta, g), {**rest, **updates}), loss

            (theta_new, rest_new), losses = jax.lax.scan(inner, (theta, rest), None, length=inner_steps)
            envelope_grad = jax.tree.map(lambda a, t: lam * (a - t), w, theta_new)
            upd, new_opt = optimizer.update(envelope_grad, opt_state, w)
            new = (optax.apply_updates(w, upd), theta_new, rest_new, new_opt)
            kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry)
            return kept, losses[-1], active

        w = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        init = (w, w, rest, optimizer.init(w))
        (w, theta, rest, _), mean_loss = run_steps(local, data.count, n_max, step, init)
        return ({**rest, "params": w}, {**rest, "params": theta}), mean_loss

    return train


def trainees(part: Participants, train_all: bool) -> Participants:
    """Who trains this round: the participants, or every client (weight 0 unless sampled)."""
    if not train_all:
        return part
    num = part.num_clients
    weights = part.scatter(jnp.zeros((num,), jnp.float32), part.weights)
    return part._replace(ids=jnp.arange(num), weights=weights)


def client_update(hp: PFedMeHyper, state: PFedMeState, cid, inputs, data, key):
    """ONE client: R Moreau-envelope local steps from w; returns (w_i, theta_i)."""
    return hp.train(state.global_params, data, key)


def server_update(hp: PFedMeHyper, state: PFedMeState, outputs, who: Participants):
    """w mixed with beta towards the weighted mean of the sampled w_i; the trainees' theta_i stored."""
    w_new, theta = outputs
    return state._replace(
        global_params=aggregate.server_step(state.global_params, who.mean(w_new), hp.beta),
        client_personal=who.scatter(state.client_personal, theta),
    ), {}


def step(hp: PFedMeHyper, client_map, state: PFedMeState, data: ClientData, part: Participants):
    """Every trainee trains and receives w (bytes_down); the sampled ones (weight > 0)
    reach w. The train loss is their weighted mean (here, as the trainees may be all C)."""
    who = trainees(part, hp.train_all)
    outputs, losses = map_clients(functools.partial(client_update, hp), client_map, state, data, who)
    new_state, metrics = server_update(hp, state, outputs, who)
    metrics["train_loss"] = jnp.sum(aggregate.normalized_weights(who.weights) * losses)
    metrics["bytes_down"] = jnp.float32(who.k * hp.model_bytes)
    return new_state, None, metrics


def init(model: Model, key, params_template=None, num_clients: int = 1) -> PFedMeState:
    params = model.initial(key, params_template)
    return PFedMeState(params, broadcast(params, num_clients), jnp.zeros([], jnp.int32))


def evaluate(model: Model, client_map, loss, state: PFedMeState, data: ClientData, key):
    """Each client's personalized model theta_i on its test rows."""
    return evaluate_clients(
        model.apply, lambda c: take(state.client_personal, c), data.test, client_map, loss
    )


HOST_STORAGE_REFUSED = refused_when(
    "train_all",
    True,
    "train_all=True (the default, the paper's) trains every client each round; "
    "train_all=False trains only the participants",
)


DOMAINS = {
    "lam": Domain(0, low_open=True),
    "inner_steps": Domain(1, integer=True),
    "personal_lr": Domain(0, low_open=True),
    "beta": Domain(0, low_open=True, note="1: plain averaging"),
    "personal_l2": Domain(0),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    lam: float = 15.0,
    inner_steps: int = 5,
    personal_lr: float = 0.1,
    beta: float = 1.0,
    personal_l2: float = 0.0,
    train_all: bool = True,
    weighting: str = "uniform",
) -> Algorithm:
    """pFedMe.

    Args:
      lam: Moreau-envelope weight lambda (> 0).
      inner_steps: K gradient steps of the personalized problem per local step.
      personal_lr: step size of those K steps.
      beta: server mixing weight (1: plain averaging).
      personal_l2: the authors' code's extra L2 weight mu on theta (paper: 0).
      train_all: every client trains each round, only the sampled ones send (paper).
      weighting: "uniform" (paper) or "samples".
      Others: as fedavg.build; eta is the learning rate of `local.optimizer`.
    """
    check_weighting(weighting)
    local = local.validate()
    cmap = as_client_map(client_map)
    train = make_moreau_train(model.apply, local, lam, inner_steps, personal_lr, personal_l2)
    model_bytes = P.tree_bytes(model.template())
    hp = PFedMeHyper(train, beta, train_all, model_bytes)
    return Algorithm(
        functools.partial(init, model),
        federated_round(
            functools.partial(step, hp, cmap),
            clients_per_round=clients_per_round,
            weighting=weighting,
            bytes_up=model_bytes,
        ),
        functools.partial(evaluate, model, cmap, local.loss),
    )
