"""APPLE (Luo & Wu, "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning", IJCAI 2022).

Every client i keeps a core model c_i (uploaded) and a directed relationship (DR)
vector p_i [C] over all clients' core models. Its personalized model, the one it
trains with and is evaluated on (see Evaluation), is

    w_i = sum_j p_ij c_j

(one einsum of p_i with the stacked [C, ...] cores, `aggregate.mix`). In a round a
participant downloads every other core model (as they were at the round's start),
and on each minibatch takes one step on

    loss(w_i) + lambda(r) mu ||p_i - p0||^2,   p0_j = n_j / sum_k n_k

for its own core c_i (gradient p_ii dloss/dw, through `local.optimizer`) and for
p_i (gradient <dloss/dw, c_j> + 2 lambda(r) mu (p_i - p0)_j, plain SGD with
`dr_learning_rate`); the other cores stay fixed. It uploads c_i; p_i stays local.
The proximal term pulls the personalization towards FedAvg's weights early on;
its weight decays: lambda(r) = (cos(pi r / L) + 1) / 2 ("cosine") or
0.001^(r / L) ("exponential") for rounds r < L, then 0.

Options: `dr_learning_rate` (0.001), `mu` (0.1), `L` (16 rounds), `scheduler`
("cosine"), `dr_gradient` ("exact"), `p_init` ("samples"), `scale_core_lr` (False).
The paper's defaults are read from its authors' code (ljaiverson/pFL-APPLE:
lr_coef 0.001, mu 0.1, the schedule ending at 10% of its 160 rounds, i.e. 16);
PFLlib's main.py has -dlr 0.0 and -mu 0.0, which freeze p (no DR learning, no
proximal term), and -L 1.0 (the whole run). "cosine" is PFLlib's schedule (the
authors' code offers both, "exponential" by default).

Paper vs code: the authors' code (the paper's) starts every p_i at p0 (`p_init=
"samples"`) and differentiates exactly (`dr_gradient="exact"`); PFLlib
(clientapple.py / serverapple.py) starts p_i uniform (`p_init="uniform"`), takes
as p's gradient the mean over parameter tensors of mean(dloss/dw * c_j)
(`dr_gradient="leaf_mean"`) and multiplies the core learning rate by C
(`scale_core_lr=True`: the core gradient times C, the same for SGD). PFLlib's
proximal gradient is lambda mu (p - p0), half of the authors' (set mu to half of
PFLlib's -mu for the same step), its lambda lags one round, and it takes p's
gradient after the core's step (with the updated own core; here, as in the
authors' autodiff, both from the same point). PFLlib trains its clients one after
the other on shared core objects (later clients see cores trained that round),
and after its round a client shares a copy of its personalized model as its core
model (`model_c = deepcopy(model)`), not the core it trained; that personalized
model (also what PFLlib evaluates) is the mix its last step was taken at, formed
before that step's core update (`aggregate_parameters` at the start of each step):
`sequential=True` (a scan over the participants in client-id order). Not reproduced: PFLlib trains
every client each round whatever the join ratio; the authors' code
uses SGD momentum 0.9 for cores and p, here `local.optimizer` for the core and
plain SGD for p. All cores start from the same initial model (PFLlib's; the
authors' code draws one per client). The authors' limited-bandwidth download
of M core models chosen by |p| is not implemented: a participant downloads all
C - 1 other cores.

Evaluation: each client's personalized model as it holds it after its last round,
its final core and p with the other cores as it downloaded them (the authors'
ClientNet; with `sequential`, PFLlib's `self.model`, the mix of its last step); the
cores other participants trained in the same round enter at its next round (mixing
the new cores without the client's p adapting to them can be far worse: they moved
for other clients' data). A client's
p_i is its stored row once it has trained, else the `p_init` row (from the train
sizes). `collaboration_matrix`: |p_i| normalized (rows never trained: uniform).
Only the "params" collection is mixed; other collections (BatchNorm statistics)
are the client's own core's.

State: `client_core` [C, ...] core models, `client_personal` [C, ...] personalized
models, `client_p` [C, C] DR vectors, `client_rounds` [C] rounds trained, `round`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, epoch_orders, first_order, local_batch, run_steps
from pfljax.core.losses import Loss, get_loss, masked_mean
from pfljax.core.round import Participants, federated_round, map_clients
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

SCHEDULERS = ("cosine", "exponential")
DR_GRADIENTS = ("exact", "leaf_mean")
P_INITS = ("samples", "uniform")
EXP_FLOOR = 0.001  # the exponential schedule's value at r = L (the authors' epsilon)


class APPLEState(NamedTuple):
    client_core: Any  # c_i, full variables [C, ...]
    client_personal: Any  # sum_j p_ij c_j as client i holds it after its last round [C, ...]
    client_p: jax.Array  # [C, C] DR vectors p_i
    client_rounds: jax.Array  # [C] int32 rounds each client trained
    round: jax.Array


class APPLEHyper(NamedTuple):
    """What a round needs (see `build` for the options)."""

    apply: Any
    local: LocalTraining
    loss: Loss
    dr_learning_rate: float
    mu: float
    L: int
    scheduler: str
    dr_gradient: str
    p_init: str
    scale_core_lr: bool
    sequential: bool = False


def schedule(hp: APPLEHyper, round_: jax.Array) -> jax.Array:
    """lambda(r): (cos(pi r / L) + 1) / 2 or 0.001^(r / L) for r < L, else 0."""
    r = round_.astype(jnp.float32)
    frac = r / jnp.maximum(hp.L, 1)
    value = (jnp.cos(math.pi * frac) + 1.0) / 2.0 if hp.scheduler == "cosine" else EXP_FLOOR**frac
    return jnp.where(r < hp.L, value, 0.0)


def sample_weights(counts: jax.Array) -> jax.Array:
    """p0 [C]: n_j / sum_k n_k."""
    return aggregate.normalized_weights(counts)


def current_p(hp: APPLEHyper, state: APPLEState, counts: jax.Array) -> jax.Array:
    """[C, C] every client's DR vector: its stored row once trained, else the initial row."""
    num = counts.shape[0]
    first = sample_weights(counts) if hp.p_init == "samples" else jnp.full((num,), 1.0 / num)
    return jnp.where((state.client_rounds > 0)[:, None], state.client_p, first[None])


def personalized_params(p: jax.Array, cores: Any) -> Any:
    """sum_j p_j c_j of one DR vector p [C] and the stacked cores [C, ...]: one einsum."""
    with jax.default_matmul_precision("highest"):
        return jax.tree.map(lambda x: x[0], aggregate.mix(p[None], cores))


def dr_gradient(hp: APPLEHyper, cores: Any, own_delta: Any, grad: Any, cid) -> jax.Array:
    """[C] the loss's gradient in p: <g, c_j> ("exact"), or the mean over parameter
    tensors of mean(g * c_j) ("leaf_mean", PFLlib's). c_cid is the client's current
    core: the stored one plus `own_delta`."""
    leaves = list(zip(jax.tree.leaves(cores), jax.tree.leaves(own_delta), jax.tree.leaves(grad)))
    total = 0.0
    for core, delta, g in leaves:
        dots = jnp.einsum("j...,...->j", core, g, precision=jax.lax.Precision.HIGHEST)
        dots = dots.at[cid].add(jnp.sum(delta * g))
        total = total + (dots / g.size if hp.dr_gradient == "leaf_mean" else dots)
    return total / len(leaves) if hp.dr_gradient == "leaf_mean" else total


def local_train(hp: APPLEHyper, cores: Any, cid, core_vars: Any, held: Any, p, p0, lam, data, key):
    """ONE client's local steps on the core batch schedule: its core c_i (through
    `local.optimizer`) and p (plain SGD) on loss(sum_j p_j c_j) + lam mu ||p - p0||^2.
    Returns (core variables, personalized variables, p, mean loss): the personalized
    model of the final core and p with the other cores as downloaded; with `sequential`,
    PFLlib's: the mix its last step was taken at (`held`, the params it held, if none)."""
    spec = hp.local
    n_max = data.x.shape[0]
    stored = cores["params"]
    own0 = take(stored, cid)
    params = core_vars["params"]
    rest = {k: v for k, v in core_vars.items() if k != "params"}
    opt_state = spec.optimizer.init(params)
    scale = jax.tree.leaves(stored)[0].shape[0] if hp.scale_core_lr else 1
    orders = epoch_orders(spec, key, data.count, n_max)

    def loss_of(w, rest, xb, yb, wb):
        out, updates = hp.apply({**rest, "params": w}, xb, train=True)
        return masked_mean(hp.loss.per_example(out, yb), wb), updates

    value_and_grad = jax.value_and_grad(loss_of, has_aux=True)

    def step(carry, s):
        params, rest, opt_state, p, _, order = carry
        order, rows, weights, active = local_batch(spec, key, s, data.count, n_max, orders, order)
        xb, yb = data.x[rows], data.y[rows]
        delta = jax.tree.map(jnp.subtract, params, own0)
        w = jax.tree.map(lambda m, d: m + p[cid] * d, personalized_params(p, stored), delta)
        (loss, updates), g = value_and_grad(w, rest, xb, yb, weights)
        core_grad = jax.tree.map(lambda x: (scale * p[cid]) * x, g)
        p_grad = dr_gradient(hp, stored, delta, g, cid) + 2.0 * lam * hp.mu * (p - p0)
        upd, new_opt = spec.optimizer.update(core_grad, opt_state, params)
        new = (
            optax.apply_updates(params, upd),
            {**rest, **updates},
            new_opt,
            p - hp.dr_learning_rate * p_grad,
            w if hp.sequential else None,  # the mix this step was taken at (sequential)
        )
        kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry[:-1])
        return (*kept, order), loss, active

    order0 = first_order(spec, key, data.count, n_max, orders)
    (params, rest, _, p, last_w, _), mean_loss = run_steps(
        spec, data.count, n_max, step, (params, rest, opt_state, p, held if hp.sequential else None, order0)
    )
    delta = jax.tree.map(jnp.subtract, params, own0)
    personal = jax.tree.map(lambda m, d: m + p[cid] * d, personalized_params(p, stored), delta)
    return {**rest, "params": params}, {**rest, "params": last_w if hp.sequential else personal}, p, mean_loss


def client_update(hp: APPLEHyper, p0, lam, state: APPLEState, cid, p, data, key):
    """ONE client: its core and DR vector trained against the round's cores; returns
    ((core, personalized model, p), loss)."""
    own, held = take((state.client_core, state.client_personal["params"]), cid)
    core, personal, p, loss = local_train(hp, state.client_core, cid, own, held, p, p0, lam, data, key)
    return (core, personal, p), loss


def train_in_turn(update, state: APPLEState, data: ClientData, part: Participants, p_rows):
    """`sequential`: the participants train one after another in client-id order, each against
    the cores as the ones before it left them (PFLlib's shared core objects); outputs in the
    participants' order, as `map_clients` gives them."""

    def one(cores, k):
        cid = part.ids[k]
        out, loss = update(
            state._replace(client_core=cores), cid, p_rows[k], take(data.train, cid), part.client_key(cid)
        )
        cores = jax.tree.map(lambda stacked, row: stacked.at[cid].set(row), cores, out[0])
        return cores, (out, loss)

    order = jnp.argsort(part.ids)
    outs, losses = jax.lax.scan(one, state.client_core, order)[1]
    back = jnp.argsort(order)
    return jax.tree.map(lambda x: x[back], outs), losses[back]


def make_step(hp: APPLEHyper, client_map, model_bytes: int):
    """The round's step: every participant reads all C cores; the server stores the
    participants' cores (with `sequential`, their personalized models) and DR vectors."""

    def step(state: APPLEState, data: ClientData, part: Participants):
        counts = data.train.count
        p0 = sample_weights(counts)
        lam = schedule(hp, state.round)
        p_rows = part.gather(current_p(hp, state, counts))
        update = functools.partial(client_update, hp, p0, lam)
        if hp.sequential:
            (cores, personal, ps), losses = train_in_turn(update, state, data, part, p_rows)
        else:
            (cores, personal, ps), losses = map_clients(update, client_map, state, data, part, p_rows)
        new_state = state._replace(
            client_core=part.scatter(state.client_core, personal if hp.sequential else cores),
            client_personal=part.scatter(state.client_personal, personal),
            client_p=part.scatter(state.client_p, ps),
            client_rounds=state.client_rounds.at[part.ids].add(1),
        )
        return (
            new_state,
            losses,
            {
                # Each participant downloads the C - 1 other cores: the figure depends on C.
                "bytes_down": jnp.float32(part.k * (part.num_clients - 1) * model_bytes),
                "dr_lambda": lam,
                "p_self": jnp.mean(ps[jnp.arange(part.k), part.ids]),
            },
        )

    return step


def init(model: Model, key, params_template=None, num_clients: int = 1) -> APPLEState:
    """Every core and personalized model starts as the same model; p rows uniform
    until a client trains."""
    params = model.initial(key, params_template)
    stacked = broadcast(params, num_clients)
    return APPLEState(
        stacked,
        stacked,
        jnp.full((num_clients, num_clients), 1.0 / num_clients, jnp.float32),
        jnp.zeros((num_clients,), jnp.int32),
        jnp.zeros([], jnp.int32),
    )


def evaluate(model: Model, client_map, loss, state: APPLEState, data: ClientData, key):
    """Each client's personalized model, as it holds it, on its test rows."""
    return evaluate_clients(
        model.apply, lambda c: take(state.client_personal, c), data.test, client_map, loss
    )


def collaboration_matrix(state: APPLEState) -> jax.Array:
    """[C, C] |p_ij| / sum_j |p_ij| (uniform rows for a zero vector)."""
    a = jnp.abs(state.client_p)
    total = jnp.sum(a, axis=1, keepdims=True)
    return jnp.where(total > 0, a / jnp.where(total > 0, total, 1.0), 1.0 / a.shape[1])


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "every participant downloads all C core models, rows of clients that do not take part, "
    "and keeps a [C] DR vector"
)

DOMAINS = {
    "dr_learning_rate": Domain(0, note="0: p fixed"),
    "mu": Domain(0, note="0: no proximal term"),
    "L": Domain(0, integer=True, note="rounds; 0: no proximal term"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    dr_learning_rate: float = 0.001,
    mu: float = 0.1,
    L: int = 16,  # the paper's name
    scheduler: str = "cosine",
    dr_gradient: str = "exact",
    p_init: str = "samples",
    scale_core_lr: bool = False,
    sequential: bool = False,
) -> Algorithm:
    """APPLE: personalized models mixed from all core models by learned DR vectors.

    Args:
      model: the client model.
      local: local training of the core model (optimizer, schedule, loss).
      clients_per_round: K clients sampled per round (None: all).
      client_map: client-axis mapping strategy.
      dr_learning_rate: SGD learning rate of the DR vector p (0: p stays at its start).
      mu: weight of the proximal term lambda(r) mu ||p - p0||^2.
      L: rounds over which lambda(r) decays from 1 to 0 (0: no proximal term).
      scheduler: "cosine" or "exponential" lambda(r).
      dr_gradient: "exact" (the paper's) or "leaf_mean" (PFLlib's) gradient in p.
      p_init: "samples" (p0, the paper's code) or "uniform" (1 / C, PFLlib's).
      scale_core_lr: multiply the core's gradient by C (PFLlib's learning rate x C).
      sequential: PFLlib's code: participants train one after another (client-id order)
        against the cores as the earlier ones left them; each one's personalized model is
        the mix its last step was taken at, and it shares that model as its core.
    """
    for name, value, allowed in (
        ("scheduler", scheduler, SCHEDULERS),
        ("dr_gradient", dr_gradient, DR_GRADIENTS),
        ("p_init", p_init, P_INITS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    for name, flag in (("scale_core_lr", scale_core_lr), ("sequential", sequential)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    local = local.validate()
    cmap = as_client_map(client_map)
    hp = APPLEHyper(
        model.apply,
        local,
        get_loss(local.loss),
        dr_learning_rate,
        mu,
        L,
        scheduler,
        dr_gradient,
        p_init,
        scale_core_lr,
        sequential,
    )
    model_bytes = P.tree_bytes(model.template())
    return Algorithm(
        functools.partial(init, model),
        federated_round(
            make_step(hp, cmap, model_bytes), clients_per_round=clients_per_round, bytes_up=model_bytes
        ),
        functools.partial(evaluate, model, cmap, hp.loss),
        collaboration_matrix,
    )
