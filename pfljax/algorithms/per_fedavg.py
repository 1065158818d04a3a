"""Per-FedAvg (Fallah et al., "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach", NeurIPS 2020).

Each sampled client runs local meta-steps on the MAML objective
f(w - alpha * grad f(w)): with three independent minibatches D, D', D'' of its
own rows,
    w_tmp = w - alpha * grad f(w; D)
    g     = grad f(w_tmp; D')
    w    <- w - beta * g                                     ("fo", first order)
    w    <- w - beta * (g - alpha * H(w; D'') g)             ("hf", Hessian-free)
where H(w; D'') g is the paper's finite-difference estimate
(grad f(w + delta g; D'') - grad f(w - delta g; D'')) / (2 delta); "hf_exact"
uses the exact Hessian-vector product (forward-over-reverse autodiff) instead.
With ReLU networks the finite difference can straddle a kink, where the
gradient jumps and the jump is divided by 2 delta, so "hf" can land far from
"hf_exact"; on smooth losses the two agree to 1e-5 (tests/algorithms/test_per_fedavg.py).
The outer step is `local.optimizer` (beta = its learning rate; the paper uses
plain SGD). The server averages the returned models uniformly, as the paper's
Algorithm 1 (`weighting="samples"` weights by train size, as the pFedMe
authors' reimplementation does). Evaluation personalizes first: each client
takes `adapt_steps` (paper: 1) plain SGD steps of size alpha on minibatches of
its train rows (drawn with fold_in(evaluation key, client)), then tests.

Schedule: `local.steps` = meta-steps per round; with `local.epochs` = E, a
client takes ceil(E * ceil(n / B) / m) meta-steps, m = 2 ("fo") or 3 ("hf*")
minibatches per meta-step. alpha defaults to 0.01 (the paper tunes alpha and
beta per dataset).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, num_scan_steps, step_batch
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

VARIANTS = ("fo", "hf", "hf_exact")


class PerFedAvgState(NamedTuple):
    global_params: Any  # the meta-model (full variables)
    round: jax.Array


class MetaHyper(NamedTuple):
    """One meta-step: the minibatch gradient, alpha, the variant and its delta."""

    value_and_grad: Callable
    alpha: float
    variant: str
    delta: float


def make_batch_grad(apply_fn, loss):
    """grad_fn(params, rest, x, y, w) -> ((loss, updates), grads) of one weighted minibatch."""
    loss = get_loss(loss)

    def batch_loss(params, rest, xb, yb, wb):
        out, updates = apply_fn({**rest, "params": params}, xb, train=True)
        return masked_mean(loss.per_example(out, yb), wb), updates

    return jax.value_and_grad(batch_loss, has_aux=True)


def sgd_step(params, grads, lr):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def split_params(variables):
    """(params, the other collections) of a variables dict."""
    return variables["params"], {k: v for k, v in variables.items() if k != "params"}


def make_adapt(apply_fn, local: LocalTraining, alpha: float, steps: int):
    """adapt(variables, data, key) -> variables after `steps` SGD steps of size alpha."""
    value_and_grad = make_batch_grad(apply_fn, local.loss)

    def adapt(variables, data: ClientArrays, key):
        params, rest = split_params(variables)
        for b in range(steps):
            rows, w, _ = step_batch(local, key, jnp.int32(b), data.count, data.x.shape[0])
            (_, updates), g = value_and_grad(params, rest, data.x[rows], data.y[rows], w)
            params, rest = sgd_step(params, g, alpha), {**rest, **updates}
        return {**rest, "params": params}

    return adapt


def hessian_vector(hp: MetaHyper, params, rest, batch, g):
    """H(params; batch) g: finite differences ("hf") or forward-over-reverse ("hf_exact")."""

    def grad_at(p):
        return hp.value_and_grad(p, rest, *batch)[1]

    if hp.variant == "hf_exact":
        return jax.jvp(grad_at, (params,), (g,))[1]
    plus = grad_at(jax.tree.map(lambda p, v: p + hp.delta * v, params, g))
    minus = grad_at(jax.tree.map(lambda p, v: p - hp.delta * v, params, g))
    return jax.tree.map(lambda a, b: (a - b) / (2 * hp.delta), plus, minus)


def meta_gradient(hp: MetaHyper, params, rest, batches):
    """The MAML gradient at params from 2 ("fo") or 3 minibatches; with the
    second batch's loss and collection updates."""
    (_, _), g1 = hp.value_and_grad(params, rest, *batches[0])
    (loss, updates), g = hp.value_and_grad(sgd_step(params, g1, hp.alpha), rest, *batches[1])
    if hp.variant != "fo":
        hvp = hessian_vector(hp, params, rest, batches[2], g)
        g = jax.tree.map(lambda gi, h: gi - hp.alpha * h, g, hvp)
    return g, loss, updates


def make_meta_train(apply_fn, local: LocalTraining, alpha: float, variant: str, delta: float):
    """train(variables, data, key) -> (variables, mean meta-loss) for ONE client."""
    hp = MetaHyper(make_batch_grad(apply_fn, local.loss), alpha, variant, delta)
    per_step = 2 if variant == "fo" else 3
    optimizer = local.optimizer

    def train(variables, data: ClientArrays, key):
        n_max = data.x.shape[0]
        steps = local.steps if local.steps is not None else -(-num_scan_steps(local, n_max) // per_step)

        def batch(b):
            rows, w, _ = step_batch(local, key, b, data.count, n_max)
            return data.x[rows], data.y[rows], w

        def step(carry, s):
            params, rest, opt_state = carry
            batches = [batch(s * per_step + i) for i in range(per_step)]
            g, loss, updates = meta_gradient(hp, params, rest, batches)
            upd, new_opt = optimizer.update(g, opt_state, params)
            new = (optax.apply_updates(params, upd), {**rest, **updates}, new_opt)
            active = step_batch(local, key, s * per_step, data.count, n_max)[2]
            kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry)
            return kept, (loss * active, active)

        params, rest = split_params(variables)
        init = (params, rest, optimizer.init(params))
        (params, rest, _), (losses, active) = jax.lax.scan(step, init, jnp.arange(steps))
        return {**rest, "params": params}, jnp.sum(losses) / jnp.maximum(jnp.sum(active), 1)

    return train


def client_update(train: Callable, state: PerFedAvgState, cid, inputs, data, key):
    """ONE client: local meta-steps from the meta-model."""
    return train(state.global_params, data, key)


def server_update(state: PerFedAvgState, outputs, part: Participants):
    """The new meta-model: the weighted mean of the returned models."""
    average, metrics = part.average(outputs, state.global_params)
    return state._replace(global_params=average), metrics


def init(model: Model, key, params_template=None, num_clients: int = 1) -> PerFedAvgState:
    params = model.initial(key, params_template)
    return PerFedAvgState(params, jnp.zeros([], jnp.int32))


def evaluate(model: Model, client_map, loss, adapt: Callable, state: PerFedAvgState, data: ClientData, key):
    """Client c adapts the meta-model on its train rows (key fold_in(key, its client id)), then tests."""

    def adapted(c):
        return adapt(state.global_params, take(data.train, c), jax.random.fold_in(key, data.client_id(c)))

    return evaluate_clients(model.apply, adapted, data.test, client_map, loss)


DOMAINS = {
    "alpha": Domain(0, low_open=True),
    "delta": Domain(0, low_open=True),
    "adapt_steps": Domain(0, integer=True),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    alpha: float = 0.01,
    variant: str = "fo",
    delta: float = 1e-3,
    adapt_steps: int = 1,
    weighting: str = "uniform",
    privacy: ClientDP | None = None,
) -> Algorithm:
    """Per-FedAvg.

    Args:
      alpha: inner (personalization) step size, also used for the evaluation-time adaptation.
      variant: "fo" (first order), "hf" (Hessian-free, finite differences) or
        "hf_exact" (exact Hessian-vector product).
      delta: finite-difference step of "hf".
      adapt_steps: SGD steps of size alpha before each client's evaluation.
      weighting: "uniform" (paper) or "samples".
      Others: as fedavg.build; beta is the learning rate of `local.optimizer`.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_weighting(weighting)
    local = local.validate()
    cmap = as_client_map(client_map)
    train = make_meta_train(model.apply, local, alpha, variant, delta)
    adapt = make_adapt(model.apply, local, alpha, adapt_steps)
    model_bytes = P.tree_bytes(model.template())
    step = client_step(functools.partial(client_update, train), server_update, cmap)
    return Algorithm(
        functools.partial(init, model),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=model_bytes,
            bytes_down=model_bytes,
        ),
        functools.partial(evaluate, model, cmap, local.loss, adapt),
    )
