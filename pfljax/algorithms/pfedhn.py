"""pFedHN (Shamsian, Navon, Fetaya and Chechik, "Personalized Federated Learning
using Hypernetworks", ICML 2021).

A server hypernetwork h(v_c; phi) maps client c's learned embedding v_c to the
full parameters of its model. One round, for each sampled client c:
theta_c = h(v_c), the client trains locally to theta~_c and sends back
delta_c = theta~_c - theta_c; the server steps phi and the embeddings along
(d theta_c / d (phi, v))^T (-delta_c), one VJP (`pfljax.core.hypernet`).
Predictions use h(v_c) as is (no fine-tuning).

The paper samples one client per hypernetwork step. With K clients per round
(all trained from the same hypernetwork) the default steps once on the SUM of
their gradients, to first order the paper's K one-client steps, so a round of K
clients moves the hypernetwork as far as K paper steps; `combine="mean"` steps
on their mean instead (K = 1: both are the paper's loop). Measured on
Fashion-MNIST (10 clients, 4 classes each, MLP, 300 samples per client, the
code's 50 inner steps, 100 rounds): sum 89.4% final accuracy, mean 83.2%
(`python -m experiments.compare
--config=experiments/configs/baselines_b_fmnist.py:noniid1_10,small,pfedhn_inner
--algorithms=pfedhn --config.rounds=100 [--config.pfedhn.combine=mean] --workdir=...`).
Defaults follow the released code (AvivSham/pFedHN, experiments/pfedhn):
embedding dim int(1 + C / 4) (`embedding_dim=0`), trunk Linear(E, 100) then
3 x (ReLU, Linear(100, 100)) with no ReLU at the end, PyTorch Linear and
Embedding inits, and the hypernetwork optimizer SGD(lr 1e-2, momentum 0.9,
weight decay 1e-3) after clipping the gradient's global norm to 50. Its local
training (SGD lr 5e-3, momentum 0.9, weight decay 5e-5, 50 steps of batch 64,
gradient clip 50) is the `local` argument. Model collections other than
"params" (BatchNorm statistics) are not generated: each client keeps its own.

The round is `federated_round` (train_loss: the unweighted mean over the K
clients) with `hypernet.generated_step`: `generate_starts` (the K models and the
pullback), `client_update` (local training, delta back), `server_update` (one
hypernetwork step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import hypernet as H
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked, is_traced, known_zero
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.round import Participants, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

COMBINES = ("mean", "sum")


class PFedHNState(NamedTuple):
    global_hn: dict  # hypernetwork params; its embedding table is [C, E]
    global_opt_state: Any
    client_extra: dict  # non-"params" collections, leaves [C, ...] (empty for most models)
    round: jax.Array


class PFedHNHyper(NamedTuple):
    """What the pieces need: the local trainer, the hypernetwork (`hypernet(C)`), the
    model's "params" layout (leaf paths and treedef, in head order), the optimizer
    and how the K clients' gradients combine."""

    train: Callable
    hypernet: Callable[[int], H.HyperNet]
    paths: tuple[str, ...]
    treedef: Any
    optimizer: optax.GradientTransformation
    combine: str


def make_hypernet(shapes: dict, embedding_dim: int, hidden: tuple[int, ...], num_clients: int) -> H.HyperNet:
    """The hypernetwork for C clients: one head per "params" leaf (E = int(1 + C / 4) if 0)."""
    dim = embedding_dim or int(1 + num_clients / 4)
    return H.mlp_hypernet(
        shapes, num_embeddings=num_clients, embedding_dim=dim, hidden=hidden, relu_last=False
    )


def generate(hp: PFedHNHyper, hn_params: dict, c: jax.Array) -> dict:
    """Client c's "params" tree, h(v_c)."""
    out = hp.hypernet(1).apply(hn_params, c)  # apply does not depend on the table size
    return jax.tree.unflatten(hp.treedef, [out[p] for p in hp.paths])


def init(hp: PFedHNHyper, model: Model, key, params_template=None, num_clients: int = 1) -> PFedHNState:
    """A fresh hypernetwork (the template only supplies the other collections)."""
    k_hn, k_model = jax.random.split(key)
    hn_params = hp.hypernet(num_clients).init(k_hn)
    variables = model.init(k_model) if params_template is None else params_template
    extra = {k: v for k, v in variables.items() if k != "params"}
    return PFedHNState(
        hn_params, hp.optimizer.init(hn_params), broadcast(extra, num_clients), jnp.zeros([], jnp.int32)
    )


def generate_starts(hp: PFedHNHyper, state: PFedHNState, part: Participants):
    """The K personalized models in one batched forward pass, and its pullback."""
    return H.vjp_generate(lambda p: jax.vmap(lambda c: generate(hp, p, c))(part.ids), state.global_hn)


def client_update(hp: PFedHNHyper, state: PFedHNState, cid, start, data, key):
    """ONE client trains its generated model; returns (delta, its other collections), loss."""
    extra = take(state.client_extra, cid)
    res = hp.train({**extra, "params": start}, data, key)
    delta = jax.tree.map(jnp.subtract, res.params["params"], start)
    return (delta, {c: v for c, v in res.params.items() if c != "params"}), res.loss


def server_update(hp: PFedHNHyper, state: PFedHNState, outputs, part: Participants, grad_of, starts):
    """One hypernetwork step on the sum (or mean) of the K pullbacks of -delta (the
    clients return their delta; `starts` unused)."""
    del starts
    deltas, extra = outputs
    scale = 1.0 / part.k if hp.combine == "mean" else 1.0
    grads = jax.tree.map(lambda g: g * scale, grad_of(deltas))
    hn_params, opt_state = H.apply_grads(hp.optimizer, state.global_hn, state.global_opt_state, grads)
    new_state = state._replace(
        global_hn=hn_params, global_opt_state=opt_state, client_extra=part.scatter(state.client_extra, extra)
    )
    return new_state, {"hn_grad_norm": optax.tree.norm(grads)}


def evaluate(hp: PFedHNHyper, model: Model, client_map, loss, state: PFedHNState, data: ClientData, key):
    """Each client's generated model on its test rows (deterministic: `key` is unused)."""
    del key

    def variables_of(c):
        return {**take(state.client_extra, c), "params": generate(hp, state.global_hn, c)}

    return evaluate_clients(model.apply, variables_of, data.test, client_map, loss)


def make_optimizer(lr: float, momentum: float, weight_decay: float, clip_norm: float):
    """The hypernetwork's optimizer: SGD with momentum and weight decay after clipping
    the gradient's global norm (0: no clip, also for a traced 0), as the released code."""
    clip = jnp.where(clip_norm > 0, clip_norm, jnp.inf) if is_traced(clip_norm) else clip_norm
    return optax.chain(
        optax.identity() if known_zero(clip_norm) else optax.clip_by_global_norm(clip),
        optax.add_decayed_weights(weight_decay),
        optax.sgd(lr, momentum=None if known_zero(momentum) else momentum),
    )


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "its hypernetwork holds one embedding per client in the global state, indexed by client id"
)

DOMAINS = {
    "embedding_dim": Domain(0, integer=True, note="0: int(1 + C / 4)"),
    "hn_hidden": Domain(1, integer=True, note="each width"),
    "hn_lr": Domain(0, low_open=True),
    "hn_momentum": Domain(0, 1, high_open=True),
    "hn_weight_decay": Domain(0),
    "hn_clip_norm": Domain(0, note="0: no clip"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    embedding_dim: int = 0,
    hn_hidden: tuple = (100, 100, 100, 100),
    hn_lr: float = 1e-2,
    hn_momentum: float = 0.9,
    hn_weight_decay: float = 1e-3,
    hn_clip_norm: float = 50.0,
    combine: str = "sum",
) -> Algorithm:
    """pFedHN.

    Args:
      model: the client (target) model; the hypernetwork emits its "params".
      local: local training hyperparameters (the paper's inner loop).
      clients_per_round: K clients sampled per round (None: all).
      client_map: client-axis mapping strategy.
      embedding_dim: client embedding size E (0: int(1 + C / 4), the code's).
      hn_hidden: widths of the hypernetwork trunk's Linear layers.
      hn_lr, hn_momentum, hn_weight_decay: hypernetwork SGD.
      hn_clip_norm: clip the hypernetwork gradient's global norm (0: no clip).
      combine: "mean" (one step on the mean of the K clients' gradients) or
        "sum" (one step on their sum: to first order, K steps of the paper's
        one-client loop).
    """
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if not hn_hidden:
        raise ValueError(f"hn_hidden must be a non-empty tuple of widths, got {hn_hidden}")
    hn_hidden = tuple(int(h) for h in hn_hidden)
    cmap = as_client_map(client_map)
    template = model.template()["params"]
    paths = tuple(P.leaf_paths(template))
    shapes = {p: leaf.shape for p, leaf in zip(paths, jax.tree.leaves(template))}
    hp = PFedHNHyper(
        make_local_train(model.apply, local),
        functools.partial(make_hypernet, shapes, embedding_dim, hn_hidden),
        paths,
        jax.tree.structure(template),
        make_optimizer(hn_lr, hn_momentum, hn_weight_decay, hn_clip_norm),
        combine,
    )
    step = H.generated_step(
        functools.partial(generate_starts, hp),
        functools.partial(client_update, hp),
        functools.partial(server_update, hp),
        cmap,
    )
    size = P.tree_bytes(template)  # bytes of one model, each way
    return Algorithm(
        functools.partial(init, hp, model),
        federated_round(
            step, clients_per_round=clients_per_round, weighting="uniform", bytes_up=size, bytes_down=size
        ),
        functools.partial(evaluate, hp, model, cmap, local.loss),
    )
