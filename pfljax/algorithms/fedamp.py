"""FedAMP (Huang et al., "Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI 2021).

Every client keeps its own model w_i (evaluated on its test rows). One round, on the
server first (attentive message passing), for the K participants' stored models:

    u_i = sum_j xi_ij w_j,   xi_ij = alpha_k A'(||w_i - w_j||^2) (j != i),
    xi_ii = 1 - sum_{j != i} xi_ij,   A'(x) = exp(-x / sigma) / sigma

(A(x) = 1 - exp(-x / sigma), the paper's attention-inducing function): the
personalized cloud model u_i, ONE einsum of the [K, K] matrix xi with the stacked
[K, ...] models (`aggregate.mix`). Then each participant trains w_i from u_i on

    F_i(w) + lam / (2 alpha_k) ||w - u_i||^2

(the paper's proximal step; FedProx's term with mu = lam / alpha_k, on the "params"
collection) with `local`'s schedule and uploads w_i. Rows of xi sum to 1, so
identical models give u_i = w_i; far apart models (large distances against
sigma) give xi = identity, i.e. local training. Nothing keeps xi_ii >= 0: with K
close models it tends to 1 - (K - 1) alpha_k / sigma and u_i extrapolates (the
PFLlib defaults on its 20-client FMNIST setting: mean xi_ii -18, -10.4, then 1.0
in rounds 1-3; the metric `self_weight`).

`attention="cosine"` is the paper's HeurFedAMP (its heuristic for deep networks):
xi_ii = `self_weight`, and xi_ij = (1 - xi_ii) softmax_{j != i}(sigma cos(w_i, w_j)).
With sigma -> 0 and self_weight = 1 / K, u_i is the participants' mean.

Options (defaults: PFLlib's main.py, -alk 1.0, -lam 1.0, -sg 1.0): `alpha_k`
(alpha_k, the message-passing step, constant over rounds), `lam` (lambda), `sigma`,
`attention` ("distance": FedAMP, default; "cosine": HeurFedAMP), `self_weight`
(HeurFedAMP's xi_ii; 0.5, no reference value: PFLlib has no HeurFedAMP), `start`.
Distances and cosines are over the "params" collection (PFLlib's
model.parameters()); other collections (BatchNorm statistics) stay the client's own.

Paper vs code (PFLlib clientamp.py / serveramp.py): both use the A' form above,
alphaK * exp(-d^2 / sigma) / sigma with the self weight 1 - sum (PFLlib has no cosine
form). The paper's client step starts from the cloud model u_i (`start="cloud"`, the
default; the paper only says argmin); PFLlib's clients keep training their own w_i
(`start="own"`). PFLlib's proximal term, 0.5 lamda / alphaK ||w - u||_2 (a norm, not
squared) on detached tensors, adds no gradient: its clients train on the
cross-entropy alone; here it is the paper's lam / (2 alpha_k) ||w - u_i||^2. PFLlib
mixes the models uploaded in the previous round; here the messages are among this
round's participants (their latest models): with everyone taking part, as in the
paper's cross-silo setting, the same set. Not implemented: a decreasing alpha_k
schedule (PFLlib's help text suggests lambda / sqrt(round); its code keeps it
constant, as here).

State: `client_params` [C, ...] each client's w_i; `round`. Host storage is allowed:
a round reads and writes only its participants' models.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.round import Participants, client_step, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

ATTENTIONS = ("distance", "cosine")
STARTS = ("cloud", "own")


class FedAMPState(NamedTuple):
    client_params: Any  # w_i, full variables [C, ...]
    round: jax.Array


class FedAMPHyper(NamedTuple):
    """The proximal local trainer and the attention's settings (see `build`)."""

    train: Callable
    alpha_k: float
    sigma: float
    attention: str
    self_weight: float
    start: str


def gram(stacked: Any, center: bool) -> jax.Array:
    """[K, K] inner products <w_i, w_j> over all leaves of a stacked [K, ...] tree
    (of w_i - mean_k w_k with `center`: the same differences, less cancellation)."""
    k = jax.tree.leaves(stacked)[0].shape[0]
    total = jnp.zeros((k, k), jnp.float32)
    for leaf in jax.tree.leaves(stacked):
        x = leaf.reshape(k, -1).astype(jnp.float32)
        if center:
            x = x - jnp.mean(x, axis=0, keepdims=True)
        total = total + jnp.matmul(x, x.T, precision=jax.lax.Precision.HIGHEST)
    return total


def squared_distances(stacked: Any) -> jax.Array:
    """[K, K] ||w_i - w_j||^2 over all leaves (0 on the diagonal)."""
    g = gram(stacked, center=True)
    sq = jnp.diag(g)
    d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * g, 0.0)
    return jnp.where(jnp.eye(g.shape[0], dtype=bool), 0.0, d2)


def cosines(stacked: Any) -> jax.Array:
    """[K, K] cos(w_i, w_j) over all leaves (0 where a model is all zeros)."""
    g = gram(stacked, center=False)
    norm = jnp.sqrt(jnp.maximum(jnp.diag(g), 0.0))
    denom = norm[:, None] * norm[None, :]
    return jnp.where(denom > 0, g / jnp.where(denom > 0, denom, 1.0), 0.0)


def attention_matrix(hp: FedAMPHyper, stacked: Any) -> jax.Array:
    """xi [K, K] of K stacked models: rows sum to 1 (see the module docstring)."""
    k = jax.tree.leaves(stacked)[0].shape[0]
    eye = jnp.eye(k, dtype=bool)
    if k == 1:
        return jnp.ones((1, 1), jnp.float32)
    if hp.attention == "cosine":
        logits = jnp.where(eye, -jnp.inf, hp.sigma * cosines(stacked))
        others = (1.0 - hp.self_weight) * jax.nn.softmax(logits, axis=1)
        return jnp.where(eye, hp.self_weight, others)
    d2 = squared_distances(stacked)
    off = jnp.where(eye, 0.0, hp.alpha_k * jnp.exp(-d2 / hp.sigma) / hp.sigma)
    return off + jnp.diag(1.0 - jnp.sum(off, axis=1))


def cloud_models(hp: FedAMPHyper, stacked_params: Any) -> tuple[Any, jax.Array]:
    """(u [K, ...], xi [K, K]): the participants' personalized cloud models, one einsum."""
    xi = attention_matrix(hp, stacked_params)
    with jax.default_matmul_precision("highest"):
        return aggregate.mix(xi, stacked_params), xi


def client_inputs(hp: FedAMPHyper, state: FedAMPState, part: Participants):
    """The server's message passing: each participant's (w_i, u_i, xi row) [K, ...]."""
    w = part.gather(state.client_params)
    u, xi = cloud_models(hp, w["params"])
    return w, u, xi


def client_update(hp: FedAMPHyper, state: FedAMPState, cid, inputs, data, key):
    """ONE client: w_i trained on its loss + lam / (2 alpha_k) ||w - u_i||^2, from u_i
    (start "cloud") or its own w_i (start "own"); returns ((w_i, xi row), loss)."""
    w, u, xi_row = inputs
    start = {**w, "params": u} if hp.start == "cloud" else w
    res = hp.train(start, data, key, anchor={"params": u})
    return (res.params, xi_row), res.loss


def server_update(state: FedAMPState, outputs, part: Participants):
    """Stores the participants' models; reports the mean self-attention xi_ii."""
    trained, xi = outputs
    self_weight = jnp.mean(jnp.diagonal(xi))
    return state._replace(client_params=part.scatter(state.client_params, trained)), {
        "self_weight": self_weight
    }


def init(model: Model, key, params_template=None, num_clients: int = 1) -> FedAMPState:
    """Every client starts from the same model."""
    params = model.initial(key, params_template)
    return FedAMPState(broadcast(params, num_clients), jnp.zeros([], jnp.int32))


def evaluate(model: Model, client_map, loss, state: FedAMPState, data: ClientData, key):
    """Each client's own model w_i on its test rows."""
    return evaluate_clients(model.apply, lambda c: take(state.client_params, c), data.test, client_map, loss)


DOMAINS = {
    "alpha_k": Domain(0, low_open=True),
    "lam": Domain(0, note="0: no proximal term"),
    "sigma": Domain(0, low_open=True),
    "self_weight": Domain(0, 1),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    alpha_k: float = 1.0,
    lam: float = 1.0,
    sigma: float = 1.0,
    attention: str = "distance",
    self_weight: float = 0.5,
    start: str = "cloud",
) -> Algorithm:
    """FedAMP: attentive message passing among the participants, then proximal local training.

    Args:
      model: the client model.
      local: local training (optimizer, schedule, loss).
      clients_per_round: K clients sampled per round (None: all).
      client_map: client-axis mapping strategy.
      alpha_k: the message-passing step alpha_k (> 0); the proximal weight is lam / alpha_k.
      lam: lambda, the weight of the attention-inducing regularizer (>= 0).
      sigma: the scale sigma of A(x) = 1 - exp(-x / sigma) ("distance"), or the
        cosine temperature ("cosine").
      attention: "distance" (FedAMP) or "cosine" (HeurFedAMP).
      self_weight: HeurFedAMP's xi_ii ("cosine" only).
      start: "cloud" (train from u_i, default) or "own" (from w_i, PFLlib's).
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    local = local.validate()
    cmap = as_client_map(client_map)
    train = make_local_train(model.apply, local, prox_mu=lam / alpha_k)
    hp = FedAMPHyper(train, alpha_k, sigma, attention, self_weight, start)
    step = client_step(
        functools.partial(client_update, hp), server_update, cmap, functools.partial(client_inputs, hp)
    )
    model_bytes = P.tree_bytes(model.template())
    return Algorithm(
        functools.partial(init, model),
        federated_round(
            step, clients_per_round=clients_per_round, bytes_up=model_bytes, bytes_down=model_bytes
        ),
        functools.partial(evaluate, model, cmap, local.loss),
    )
