"""FedDBE (Zhang et al., "Eliminating Domain Bias for Federated Learning in Representation Space", NeurIPS
2023).

FedAvg plus the Domain Bias Eliminator (DBE) on the features z = base(x) that the
model's last layer (one Dense, the head) reads:
- PRBM (personalized representation bias memory): a vector b_i [d] per client,
  zeros at the start, added to the features before the head: logits = head(z + b_i).
  It is trained with the model on each minibatch and never leaves the client.
- MR (mean regularization): kappa * mean_k 0.5 (r_k - g_k)^2 over the d feature
  dimensions, r the client's running mean of its batch feature means
  (r <- (1 - momentum) r + momentum * mean_batch(z), r = 0 at the start of each
  local training; only the current batch's mean carries a gradient), g the
  consensus global mean of features. It pulls the base towards client-invariant
  feature means.
Each round the participants start from the global model (base and head), train
on loss(head(z + b_i), y) + MR (`local.loss`: cross-entropy in the paper) with
`local`'s optimizer and schedule, and the server averages base and head (FedAvg,
weighted by `weighting`: train size by default, as PFLlib). A client
predicts with head(base(x) + b_i): the global model with its own PRBM (PFLlib's
evaluation does the same: the model the server just sent plus the client's b_i).

Initialization period (the global mean g): before round 0, every client trains
one local round from the initial model on the plain loss (no PRBM, no MR)
and keeps its running mean r_i; g is the train-size-weighted mean of the r_i
(clients that took no step are left out), set once and never updated; the
models trained there are discarded. Here it runs inside the compiled round: the
round whose counter is 0 first computes g over all C clients (one `client_map`
over the client axis, keys fold_in(train key, INIT_STREAM) per client id), then
runs round 0 proper, under `lax.cond`, so later rounds do not run it (replicas
vmapped over seeds or a grid, the GPU default, turn the cond into a select and
run both branches every round: about twice a round's cost). It
reads every client's data, so the clients cannot live in host memory
(HOST_STORAGE_REFUSED).

Options: `kappa` (MR weight, default 0.0: MR off) and `momentum` (running-mean
momentum, default 0.1) are PFLlib's main.py defaults (`-klw 0.0`, `-mo 0.1`):
the paper's own values could not be read here (only its abstract and summaries
were reachable). The authors' DBE repository (TsingZ0/DBE, run_me.sh) runs
FMNIST with `-mo 1 -klw 50`, i.e. momentum=1.0 (r is the current batch's mean)
and kappa=50.0: the setting of the authors' own FMNIST run.

Paper vs code: the method follows PFLlib's clientdbe / serverdbe (the authors'
code); defaults are PFLlib's (above). Where this module differs from the code:
PFLlib trains b_i with its own plain SGD at the model's learning rate; here b_i
and the model share `local.optimizer` (one optax state over both, fresh each
round), the same under PFLlib's plain SGD (an optimizer with weight decay decays
b_i too). A client that takes no step in the initialization period (empty, or
fewer than B rows with drop_last) is left out of g (PFLlib's client cannot be
built without one batch). g is weighted by train size whatever `weighting`
(which weighs the model average), as in PFLlib. Under client-level DP the model
uploads are privatized; the initialization period's feature means are not.
bytes_up / bytes_down count the model only (b_i never travels; the one-off d
floats of the initialization period are not counted).

Not implemented: DBE on top of methods other than FedAvg (the paper's
FedProx+DBE, MOON+DBE, ...), and the paper's representation-quality (MDL) study.
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
from pfljax.core.clients import ClientMap, as_client_map, take
from pfljax.core.domains import Domain, checked, known_zero
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.heads import apply_with_head, dense, feature_dim, linear_head
from pfljax.core.local import LocalTraining, epoch_orders, first_order, local_batch, own_steps, run_steps
from pfljax.core.losses import Loss, get_loss, masked_mean
from pfljax.core.privacy import ClientDP
from pfljax.core.round import (
    Participants,
    check_weighting,
    client_step,
    federated_round,
    map_clients,
)
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

PRBM = "feddbe_prbm"  # the collection holding a client's PRBM b_i at evaluation
INIT_STREAM = 0xDBE  # the initialization period's keys: fold_in(round 0's train key, INIT_STREAM)

# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "its first round (the initialization period) trains every client, participants or not, "
    "to form the global mean of features"
)


class FedDBEState(NamedTuple):
    global_params: Any  # base + head (full variables)
    global_mean: jax.Array  # [d] consensus mean of features (zeros until round 0 sets it)
    client_prbm: jax.Array  # [C, d] each client's PRBM b_i
    round: jax.Array


class FedDBEHyper(NamedTuple):
    """The model, its head's name, the local schedule and loss, and DBE's options."""

    model: Model
    head: str
    local: LocalTraining
    loss: Loss
    kappa: float
    momentum: float


class LocalOut(NamedTuple):
    """A client's local training: trained variables, PRBM, running mean r, mean loss and
    whether it took any step."""

    variables: Any
    prbm: jax.Array
    running_mean: jax.Array
    loss: jax.Array
    trained: jax.Array


def shift(z: jax.Array, prbm: jax.Array) -> jax.Array:
    """z + b: features z [B, ..., d] plus a PRBM b [d]."""
    return z + prbm.reshape((1,) * (z.ndim - 1) + prbm.shape)


def batch_mean(z: jax.Array, weights: jax.Array) -> jax.Array:
    """Mean [d] of features z [B, ..., d] over the real rows (weights [B]) and any middle axes."""
    w = weights.reshape(weights.shape + (1,) * (z.ndim - 1)).astype(z.dtype)
    rows = jnp.maximum(jnp.sum(weights), 1.0) * (z.size // (z.shape[0] * z.shape[-1]))
    return jnp.sum(z * w, axis=tuple(range(z.ndim - 1))) / rows


def objective(hp: FedDBEHyper, dbe: bool, params, rest, running, global_mean, xb, yb, wb):
    """One minibatch's loss: loss(head(z + b), y) (+ kappa * MR) with dbe, loss(head(z), y)
    without (the initialization period). Returns (total, (loss, new running mean, updates))."""
    model_params = params["model"]

    def head_fn(z):
        shifted = shift(z, params["prbm"]) if dbe else z
        return dense(model_params[hp.head], shifted), batch_mean(z, wb)

    variables = {**rest, "params": model_params}
    (out, mean_b), updates = apply_with_head(hp.model, hp.head, variables, xb, True, head_fn)
    loss = masked_mean(hp.loss.per_example(out, yb), wb)
    running = (1.0 - hp.momentum) * jax.lax.stop_gradient(running) + hp.momentum * mean_b
    total = loss
    if dbe and not known_zero(hp.kappa):
        total = total + hp.kappa * jnp.mean(0.5 * (running - global_mean) ** 2)
    return total, (loss, jax.lax.stop_gradient(running), updates)


def local_train(hp: FedDBEHyper, dbe: bool, variables, prbm, global_mean, data, key) -> LocalOut:
    """ONE client's local training on the core batch schedule (`step_batch` / `next_batch`):
    the model and (with dbe) its PRBM trained jointly by `local.optimizer`; the running mean
    r starts at 0 and follows every active step."""
    spec = hp.local
    n_max = data.x.shape[0]
    params = {"model": variables["params"], **({"prbm": prbm} if dbe else {})}
    rest = {k: v for k, v in variables.items() if k != "params"}
    opt_state = spec.optimizer.init(params)
    grad_fn = jax.grad(functools.partial(objective, hp, dbe), has_aux=True)
    orders = epoch_orders(spec, key, data.count, n_max)

    def step(carry, s):
        params, rest, opt_state, running, order = carry
        order, rows, weights, active = local_batch(spec, key, s, data.count, n_max, orders, order)
        xb, yb = data.x[rows], data.y[rows]
        grads, (loss, new_running, updates) = grad_fn(params, rest, running, global_mean, xb, yb, weights)
        upd, new_opt = spec.optimizer.update(grads, opt_state, params)
        new = (optax.apply_updates(params, upd), {**rest, **updates}, new_opt, new_running)
        kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, (params, rest, opt_state, running))
        return (*kept, order), loss, active

    order0 = first_order(spec, key, data.count, n_max, orders)
    running0 = jnp.zeros_like(global_mean)
    (params, rest, _, running, _), mean_loss = run_steps(
        spec, data.count, n_max, step, (params, rest, opt_state, running0, order0)
    )
    trained = own_steps(spec, data.count) > 0
    return LocalOut(
        {**rest, "params": params["model"]}, params.get("prbm", prbm), running, mean_loss, trained
    )


def client_update(hp: FedDBEHyper, state: FedDBEState, cid, prbm, data, key):
    """ONE participant: the global model and its PRBM trained with DBE; returns ((model, PRBM), loss)."""
    out = local_train(hp, True, state.global_params, prbm, state.global_mean, data, key)
    return (out.variables, out.prbm), out.loss


def server_update(state: FedDBEState, outputs, part: Participants):
    """Base and head: the weighted mean (FedAvg); the participants' PRBMs stored."""
    trained, prbm = outputs
    average, metrics = part.average(trained, state.global_params)
    return state._replace(global_params=average, client_prbm=part.scatter(state.client_prbm, prbm)), metrics


def init_update(hp: FedDBEHyper, state: FedDBEState, cid, inputs, data, key):
    """ONE client of the initialization period: plain training from the global model;
    returns ((running mean, took a step), loss)."""
    del cid, inputs
    out = local_train(hp, False, state.global_params, None, state.global_mean, data, key)
    return (out.running_mean, out.trained), out.loss


def initialization_period(hp: FedDBEHyper, client_map, state: FedDBEState, data: ClientData, part):
    """`state` with global_mean = the weighted mean of every client's running mean after
    one plain local round from the global model (clients that took no step left out)."""
    num = data.train.count.shape[0]
    everyone = part._replace(
        ids=jnp.arange(num),
        weights=data.train.count.astype(jnp.float32),
        train_key=jax.random.fold_in(part.train_key, INIT_STREAM),
        everyone=True,
        client_ids=None,
    )
    (means, trained), _ = map_clients(functools.partial(init_update, hp), client_map, state, data, everyone)
    return state._replace(global_mean=aggregate.weighted_mean(means, everyone.weights, trained))


def with_initialization(hp: FedDBEHyper, client_map, step: Callable) -> Callable:
    """The round's step, preceded in the round whose counter is 0 by the initialization period."""

    def dbe_step(state: FedDBEState, data: ClientData, part: Participants):
        if data.view is not None:
            raise ValueError(f"FedDBE cannot keep its clients in host memory: {HOST_STORAGE_REFUSED}")
        # data and part by closure: part's static fields (num_clients, everyone) stay Python values.
        return jax.lax.cond(
            state.round == 0,
            lambda s: step(initialization_period(hp, client_map, s, data, part), data, part),
            lambda s: step(s, data, part),
            state,
        )

    return dbe_step


def dbe_apply(model: Model, head: str, variables: dict, x: jax.Array, train: bool = False):
    """The model with the client's PRBM (variables[PRBM]["bias"]) added to the head's input."""
    rest = {k: v for k, v in variables.items() if k != PRBM}
    head_params = variables["params"][head]
    prbm = variables[PRBM]["bias"]
    return apply_with_head(model, head, rest, x, train, lambda z: dense(head_params, shift(z, prbm)))


def init(model: Model, head: str, key, params_template=None, num_clients: int = 1) -> FedDBEState:
    """The initial model; global mean and every PRBM zeros."""
    params = model.initial(key, params_template)
    d = feature_dim(model, head)
    return FedDBEState(
        params,
        jnp.zeros((d,), jnp.float32),
        jnp.zeros((num_clients, d), jnp.float32),
        jnp.zeros([], jnp.int32),
    )


def evaluate(model: Model, client_map, head: str, loss, state: FedDBEState, data: ClientData, key):
    """Each client's head(base(x) + b_i), the global model with its own PRBM, on its test rows."""
    g = state.global_params

    def personalized(c):
        return {**g, PRBM: {"bias": take(state.client_prbm, c)}}

    apply_fn = functools.partial(dbe_apply, model, head)
    return evaluate_clients(apply_fn, personalized, data.test, client_map, loss)


DOMAINS = {
    "kappa": Domain(0, note="weight of mean regularization; 0: MR off"),
    "momentum": Domain(0, 1, low_open=True, note="1: the running mean is the current batch's mean"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    kappa: float = 0.0,
    momentum: float = 0.1,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
) -> Algorithm:
    """FedDBE: FedAvg with a per-client PRBM on the features and mean regularization.

    Args:
      kappa: weight of MR (>= 0; PFLlib's default 0.0 is MR off; the authors' FMNIST run: 50).
      momentum: momentum of the running mean of batch feature means, in (0, 1] (PFLlib's
        default 0.1; the authors' FMNIST run: 1.0).
      Others: as fedavg.build; `local` sets the optimizer (of the model and the PRBM),
        schedule and loss. The model's last layer must be one Dense (the head).
    """
    check_weighting(weighting)
    local = local.validate()
    cmap = as_client_map(client_map)
    head = linear_head(model, "FedDBE")
    hp = FedDBEHyper(model, head, local, get_loss(local.loss), kappa, momentum)
    step = client_step(functools.partial(client_update, hp), server_update, cmap, "client_prbm")
    model_bytes = P.tree_bytes(model.template())
    return Algorithm(
        functools.partial(init, model, head),
        federated_round(
            with_initialization(hp, cmap, step),
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=model_bytes,
            bytes_down=model_bytes,
        ),
        functools.partial(evaluate, model, cmap, head, local.loss),
    )
