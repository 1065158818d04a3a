"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020).

The server keeps a model x and a control variate c, each client a control c_i
(all zero at the start, over the "params" collection). A sampled client starts
from y = x and takes K local steps on the corrected gradient g(y) - c_i + c
(fed to `local.optimizer`; the paper's SGD step is y <- y - eta_l (g - c_i + c)),
then updates its control:
- option II (`variant="ii"`, the paper's default): c_i+ = c_i - c + (x - y_i) / (K eta_l);
- option I (`variant="i"`): c_i+ = the gradient of its loss at x over all its rows.
It sends (y_i - x, c_i+ - c_i); the server steps x <- x + server_lr * mean(y_i - x)
and c <- c + (1 / N) * sum over the sampled clients of (c_i+ - c_i).
Both directions carry a model and a control: twice FedAvg's bytes.

Paper vs code (PFLlib's clientscaffold / serverscaffold, which agree with the
paper): eta_l is not part of an optax optimizer, so by default option II uses
c_i - c + mean over the K steps of (g - c_i + c), i.e. the mean of the minibatch
gradients along the trajectory: exactly (x - y_i) / (K eta_l) when `local.optimizer`
is SGD with rate eta_l; `local_lr=eta_l` (> 0) uses the literal formula instead
(as the code does; it differs from the default under momentum or Adam). K is the
number of steps the client took (its own under `local.epochs`). `weighting`
weighs the mean of y_i - x ("uniform", the paper's and code's 1 / |S|); c always
takes 1 / N. The global model x is evaluated on every client.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast
from pfljax.core.domains import SERVER_LR, Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, epoch_orders, own_steps, run_steps, step_batch
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

VARIANTS = ("ii", "i")


class ScaffoldState(NamedTuple):
    global_params: Any  # x (full variables)
    global_control: Any  # c, over "params"
    client_controls: Any  # c_i, over "params", [C, ...]
    round: jax.Array


class ScaffoldHyper(NamedTuple):
    """The corrected local trainer, the full-gradient function (option I), the
    variant, eta_l for the literal option II (0: mean gradient) and the server step."""

    train: Callable
    full_grad: Callable
    variant: str
    local_lr: float
    server_lr: float


def make_batch_grad(apply_fn, loss):
    """grad of the weighted mean loss of a batch w.r.t. "params", with aux (loss, collection updates)."""
    loss_obj = get_loss(loss)

    def objective(params, rest, xb, yb, wb):
        out, updates = apply_fn({**rest, "params": params}, xb, train=True)
        value = masked_mean(loss_obj.per_example(out, yb), wb)
        return value, (value, updates)

    return jax.grad(objective, has_aux=True)


def make_corrected_train(apply_fn, local: LocalTraining):
    """train(variables, correction, data, key) -> ((variables, mean gradient, K), mean loss):
    the local schedule of `local` on g(y) + correction (correction = c - c_i)."""
    grad_fn = make_batch_grad(apply_fn, local.loss)
    optimizer = local.optimizer

    def train(variables, correction, data: ClientArrays, key):
        n_max = data.x.shape[0]
        orders = epoch_orders(local, key, data.count, n_max)

        def step(carry, s):
            params, rest, opt_state, gsum = carry
            rows, wb, active = step_batch(local, key, s, data.count, n_max, orders)
            g, (loss, updates) = grad_fn(params, rest, data.x[rows], data.y[rows], wb)
            upd, new_opt = optimizer.update(jax.tree.map(jnp.add, g, correction), opt_state, params)
            new = (
                optax.apply_updates(params, upd),
                {**rest, **updates},
                new_opt,
                jax.tree.map(jnp.add, gsum, g),
            )
            kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry)
            return kept, loss, active

        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        init = (params, rest, optimizer.init(params), jax.tree.map(jnp.zeros_like, params))
        (params, rest, _, gsum), mean_loss = run_steps(local, data.count, n_max, step, init)
        k = own_steps(local, data.count)
        mean_grad = jax.tree.map(lambda g: g / jnp.maximum(k, 1), gsum)
        return ({**rest, "params": params}, mean_grad, k), mean_loss

    return train


def make_full_grad(apply_fn, local: LocalTraining):
    """full_grad(variables, data) -> the gradient of the mean loss over all real rows
    (option I), summed chunk by chunk of `local.batch_size` rows."""
    grad_fn = make_batch_grad(apply_fn, local.loss)
    b = local.batch_size

    def full_grad(variables, data: ClientArrays):
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}
        chunks = -(-data.x.shape[0] // b)

        def add(gsum, j):
            pos = j * b + jnp.arange(b)
            wb = (pos < data.count).astype(jnp.float32)
            rows = jnp.where(pos < data.count, pos, 0)
            g, _ = grad_fn(params, rest, data.x[rows], data.y[rows], wb)
            return jax.tree.map(lambda s, gi: s + gi * jnp.sum(wb), gsum, g), None

        gsum, _ = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, params), jnp.arange(chunks))
        return jax.tree.map(lambda s: s / jnp.maximum(data.count, 1), gsum)

    return full_grad


def new_control(hp: ScaffoldHyper, x, c, c_i, y, mean_grad, k, data):
    """c_i+ of option I (gradient at x) or II (mean gradient, or (x - y) / (K eta_l) given eta_l)."""
    if hp.variant == "i":
        return hp.full_grad(x, data)
    if hp.local_lr > 0:
        scale = 1.0 / (jnp.maximum(k, 1) * hp.local_lr)
        return jax.tree.map(
            lambda ci, cg, xo, yo: ci - cg + (xo - yo) * scale, c_i, c, x["params"], y["params"]
        )
    return mean_grad


def client_update(hp: ScaffoldHyper, state: ScaffoldState, cid, c_i, data, key):
    """ONE client: K corrected steps from x; returns (y_i, c_i+) and its mean loss."""
    x, c = state.global_params, state.global_control
    correction = jax.tree.map(jnp.subtract, c, c_i)
    (y, mean_grad, k), loss = hp.train(x, correction, data, key)
    return (y, new_control(hp, x, c, c_i, y, mean_grad, k, data)), loss


def server_update(hp: ScaffoldHyper, state: ScaffoldState, outputs, part: Participants):
    """x <- x + server_lr * mean(y_i - x); c <- c + sum(c_i+ - c_i) / N; the c_i+ stored."""
    y, c_new = outputs
    c_old = part.gather(state.client_controls)
    delta_c = jax.tree.map(lambda a, b: jnp.sum(a - b, axis=0) / part.num_clients, c_new, c_old)
    return state._replace(
        global_params=aggregate.server_step(state.global_params, part.mean(y), hp.server_lr),
        global_control=jax.tree.map(jnp.add, state.global_control, delta_c),
        client_controls=part.scatter(state.client_controls, c_new),
    ), {}


def init(model: Model, key, params_template=None, num_clients: int = 1) -> ScaffoldState:
    params = model.initial(key, params_template)
    zeros = jax.tree.map(jnp.zeros_like, params["params"])
    return ScaffoldState(params, zeros, broadcast(zeros, num_clients), jnp.zeros([], jnp.int32))


def evaluate(model: Model, client_map, loss, state: ScaffoldState, data: ClientData, key):
    """The global model x on each client's test rows."""
    return evaluate_clients(model.apply, lambda c: state.global_params, data.test, client_map, loss)


DOMAINS = {"server_lr": SERVER_LR, "local_lr": Domain(0, note="0: the mean gradient")}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    variant: str = "ii",
    server_lr: float = 1.0,
    local_lr: float = 0.0,
    weighting: str = "uniform",
) -> Algorithm:
    """SCAFFOLD.

    Args:
      variant: "ii" (the paper's option II, default) or "i" (gradient at x).
      server_lr: global step size eta_g (1: plain averaging of the y_i).
      local_lr: eta_l for option II's literal (x - y_i) / (K eta_l); 0 (default)
        uses the mean gradient, equal to it under SGD of rate eta_l.
      weighting: "uniform" (paper) or "samples", for the mean of y_i - x.
      Others: as fedavg.build.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_weighting(weighting)
    local = local.validate()
    cmap = as_client_map(client_map)
    template = model.template()
    hp = ScaffoldHyper(
        make_corrected_train(model.apply, local),
        make_full_grad(model.apply, local),
        variant,
        local_lr,
        server_lr,
    )
    step = client_step(
        functools.partial(client_update, hp), functools.partial(server_update, hp), cmap, "client_controls"
    )
    both = P.tree_bytes(template) + P.tree_bytes(template["params"])  # a model and a control
    return Algorithm(
        functools.partial(init, model),
        federated_round(
            step, clients_per_round=clients_per_round, weighting=weighting, bytes_up=both, bytes_down=both
        ),
        functools.partial(evaluate, model, cmap, local.loss),
    )
