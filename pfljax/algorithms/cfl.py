"""Clustered Federated Learning (Sattler, Müller and Samek, "Clustered Federated
Learning: Model-Agnostic Distributed Multitask Optimization Under Privacy
Constraints", IEEE TNNLS 2021).

All clients start in one cluster. One round (Algorithm 2 of the paper): every
sampled client trains from its cluster's model and sends its update dtheta_i;
for each cluster c with

    ||sum_i w_i dtheta_i|| < eps1   (near a stationary point of the cluster)
    max_i ||dtheta_i|| > eps2      (yet some clients are far from theirs)

the clients' pairwise cosine similarities alpha_ij are bipartitioned into c1,
c2 minimizing the largest cross similarity alpha_cross, and c splits when
gamma_max < sqrt((1 - alpha_cross) / 2). Then each cluster's model moves by the
(train-size weighted) mean update of its members (per-cluster FedAvg).

Cluster assignments are a stacked array `client_cluster` [C] and the cluster
models `cluster_params` have a fixed leading axis `max_clusters`, so the round
compiles once; a split writes the new cluster into the next free slot, and no
split happens once all slots are used.

Paper vs released code (felisat/clustered-federated-learning): the paper's
optimal bipartition (its Algorithm 1: merge by decreasing similarity until two
groups remain, i.e. single linkage) is the default, the code's complete-linkage
agglomerative clustering is `linkage="complete"`; the paper weights by train
size, the code uniformly (`weighting="uniform"`); the code also waits 20 rounds
(`warmup_rounds=20`) and splits only clusters of more than 2 clients
(`min_split_size=3`). eps1 = 0.4 and eps2 = 1.6 are the code's MNIST values;
both depend on the model, learning rate and local steps, so set them per task.
Similarities and norms use the "params" collection; averaging covers every
leaf. With partial participation only the sampled members' updates decide a
split; members not sampled stay in the part that keeps the old cluster id.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

LINKAGES = ("single", "complete")


class CFLState(NamedTuple):
    cluster_params: Any  # variables with leaves [max_clusters, ...]
    client_cluster: jax.Array  # [C] int32 cluster id of each client
    num_clusters: jax.Array  # [] int32 clusters in use (slots 0..num_clusters-1)
    round: jax.Array


def cosine_similarities(deltas) -> tuple[jax.Array, jax.Array]:
    """Pairwise cosine similarities [K, K] and norms [K] of stacked updates [K, ...]
    (0 similarity with a zero update)."""
    flat = [d.reshape(d.shape[0], -1) for d in jax.tree.leaves(deltas)]
    gram = sum(f @ f.T for f in flat)
    norms = jnp.sqrt(jnp.maximum(jnp.diagonal(gram), 0.0))
    outer = norms[:, None] * norms[None, :]
    return jnp.where(outer > 0, gram / jnp.where(outer > 0, outer, 1.0), 0.0), norms


def bipartition(sim: jax.Array, members: jax.Array, linkage: str = "single") -> jax.Array:
    """Splits the members of a similarity matrix into two groups.

    Agglomerative clustering on similarities, merging the most similar pair of
    groups until two remain. With single linkage this is the bipartition
    minimizing the largest cross-group similarity (CFL's Algorithm 1: the cut
    of the weakest edge of a maximum spanning tree).

    Args:
      sim: [K, K] symmetric similarities.
      members: [K] bool, the rows to split (others are ignored).
      linkage: "single" (group similarity = max over pairs) or "complete" (min).

    Returns:
      [K] bool: True for the members of the group NOT holding the first member.
    """
    if linkage not in LINKAGES:
        raise ValueError(f"linkage must be one of {LINKAGES}, got {linkage!r}")
    k = sim.shape[0]
    ids = jnp.arange(k)
    combine = jnp.maximum if linkage == "single" else jnp.minimum
    pair = members[:, None] & members[None, :] & ~jnp.eye(k, dtype=bool)
    start = (jnp.where(pair, sim, -jnp.inf), ids, members)

    def merge(_, carry):
        s, label, active = carry
        a, b = jnp.divmod(jnp.argmax(s), k)
        row = jnp.where(active & (ids != a) & (ids != b), combine(s[a], s[b]), -jnp.inf)
        s_new = s.at[a, :].set(row).at[:, a].set(row).at[b, :].set(-jnp.inf).at[:, b].set(-jnp.inf)
        new = (s_new, jnp.where(label == b, a, label), active.at[b].set(False))
        go = jnp.sum(active) > 2
        return jax.tree.map(lambda n, o: jnp.where(go, n, o), new, carry)

    _, label, _ = jax.lax.fori_loop(0, max(k - 2, 0), merge, start)
    return members & (label != label[jnp.argmax(members)])


class CFLHyper(NamedTuple):
    """What the pieces of a CFL round need (see `build` for the options)."""

    train: Callable
    eps1: float
    eps2: float
    gamma_max: float
    max_clusters: int
    min_split_size: int
    warmup_rounds: int
    linkage: str


class UpdateStats(NamedTuple):
    """The participants' updates as the split rule sees them: cluster ids [K],
    weights [K], cosine similarities [K, K], Gram matrix [K, K] and norms [K]."""

    assign: jax.Array
    weights: jax.Array
    sim: jax.Array
    gram: jax.Array
    norms: jax.Array


def init(model: Model, max_clusters: int, key, params_template=None, num_clients: int = 1) -> CFLState:
    params = model.initial(key, params_template)
    return CFLState(
        broadcast(params, max_clusters),
        jnp.zeros((num_clients,), jnp.int32),
        jnp.ones([], jnp.int32),
        jnp.zeros([], jnp.int32),
    )


def own_cluster(state: CFLState, part: Participants) -> jax.Array:
    """What a participant brings to the round: its cluster id."""
    return state.client_cluster[part.ids]


def client_update(hp: CFLHyper, state: CFLState, cid, cluster, data, key):
    """ONE client: trains its cluster's model and returns its update dtheta_i."""
    start = take(state.cluster_params, cluster)
    res = hp.train(start, data, key)
    return jax.tree.map(jnp.subtract, res.params, start), res.loss


def check_cluster(hp: CFLHyper, state: CFLState, stats: UpdateStats, c, carry):
    """One cluster c of the split pass: splits it into the next free slot when
    the CFL criterion holds, and records its mean and largest update norm."""
    new_assign, params, n, mean_norms, max_norms = carry
    in_use = c < state.num_clusters
    members = stats.assign == c
    w = aggregate.normalized_weights(stats.weights, members)
    mean_norm = jnp.sqrt(jnp.maximum(w @ stats.gram @ w, 0.0))
    max_norm = jnp.max(jnp.where(members, stats.norms, 0.0))
    want = (
        in_use
        & (jnp.sum(members) >= hp.min_split_size)
        & (mean_norm < hp.eps1)
        & (max_norm > hp.eps2)
        & (state.round >= hp.warmup_rounds)
        & (n < hp.max_clusters)
    )
    side = jax.lax.cond(
        want, lambda: bipartition(stats.sim, members, hp.linkage), lambda: jnp.zeros_like(members)
    )
    rest = members & ~side
    cross = jnp.max(jnp.where(side[:, None] & rest[None, :], stats.sim, -jnp.inf))
    split = want & jnp.any(side) & jnp.any(rest) & (jnp.sqrt((1.0 - cross) / 2.0) > hp.gamma_max)
    new_assign = jnp.where(split & side, n, new_assign)
    slot = jnp.minimum(n, hp.max_clusters - 1)
    params = jax.tree.map(lambda p: jnp.where(split, p.at[slot].set(p[c]), p), params)
    mean_norms = mean_norms.at[c].set(jnp.where(in_use, mean_norm, 0.0))
    max_norms = max_norms.at[c].set(jnp.where(in_use, max_norm, 0.0))
    return new_assign, params, n + split.astype(jnp.int32), mean_norms, max_norms


def split_clusters(hp: CFLHyper, state: CFLState, stats: UpdateStats):
    """Checks every cluster in use once; returns the new participant assignment
    [K], cluster params, cluster count and per-cluster mean / max update norms."""
    zeros = jnp.zeros((hp.max_clusters,), jnp.float32)
    start = (stats.assign, state.cluster_params, state.num_clusters, zeros, zeros)
    return jax.lax.fori_loop(0, hp.max_clusters, functools.partial(check_cluster, hp, state, stats), start)


def server_update(hp: CFLHyper, state: CFLState, deltas, part: Participants):
    """Splits the clusters that meet the criterion, then moves every cluster's
    model by the weighted mean update of its sampled members."""
    sim, norms = cosine_similarities(deltas["params"])
    gram = sim * norms[:, None] * norms[None, :]
    stats = UpdateStats(own_cluster(state, part), part.weights, sim, gram, norms)
    new_assign, params, n_clusters, mean_norms, max_norms = split_clusters(hp, state, stats)
    onehot = (new_assign[None, :] == jnp.arange(hp.max_clusters)[:, None]).astype(jnp.float32)
    mixing = jax.vmap(lambda member: aggregate.normalized_weights(part.weights, member))(onehot)
    new_state = state._replace(
        cluster_params=jax.tree.map(jnp.add, params, aggregate.mix(mixing, deltas)),
        client_cluster=state.client_cluster.at[part.ids].set(new_assign),
        num_clusters=n_clusters,
    )
    return new_state, {
        "num_clusters": n_clusters,
        "splits": n_clusters - state.num_clusters,
        "cluster_mean_update_norm": mean_norms,
        "cluster_max_update_norm": max_norms,
    }


def train_size_loss(step: Callable, state: CFLState, data: ClientData, part: Participants):
    """`step`, with `train_loss` weighted by train sizes whatever the weighting
    (CFL's metric before the core round; equal to the core's for "samples")."""
    new_state, losses, metrics = step(state, data, part)
    sizes = aggregate.normalized_weights(data.train.count[part.ids])
    return new_state, losses, {**metrics, "train_loss": jnp.sum(sizes * losses)}


def evaluate(model: Model, client_map, loss, state: CFLState, data: ClientData, key):
    """Each client's cluster model on its test rows."""
    return evaluate_clients(
        model.apply,
        lambda c: take(state.cluster_params, state.client_cluster[c]),
        data.test,
        client_map,
        loss,
    )


def collaboration_matrix(state: CFLState) -> jax.Array:
    """[C, C]: 1 / |cluster| between members of the same cluster, else 0."""
    same = (state.client_cluster[:, None] == state.client_cluster[None, :]).astype(jnp.float32)
    return same / jnp.sum(same, axis=1, keepdims=True)


def final_report(state: CFLState, fed_data=None, per_client=None, key=None) -> dict:
    """Number of clusters and each client's cluster id."""
    clusters = np.asarray(jax.device_get(state.client_cluster)).tolist()
    return {"num_clusters": int(jax.device_get(state.num_clusters)), "client_cluster": clusters}


DOMAINS = {
    "eps1": Domain(0),
    "eps2": Domain(0),
    "gamma_max": Domain(0, note="0: split whenever the groups are not aligned"),
    "max_clusters": Domain(1, integer=True),
    "min_split_size": Domain(2, integer=True),
    "warmup_rounds": Domain(0, integer=True),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    eps1: float = 0.4,
    eps2: float = 1.6,
    gamma_max: float = 0.0,
    max_clusters: int = 8,
    min_split_size: int = 2,
    warmup_rounds: int = 0,
    linkage: str = "single",
    weighting: str = "samples",
) -> Algorithm:
    """Clustered FL.

    Args:
      model: the client model.
      local: local training hyperparameters.
      clients_per_round: K clients sampled per round (None: all, as in the paper).
      client_map: client-axis mapping strategy.
      eps1: split only when the norm of the cluster's mean update is below this.
      eps2: ... and the largest client update norm is above this.
      gamma_max: split only when gamma_max < sqrt((1 - alpha_cross) / 2)
        (0: whenever the two groups are not perfectly aligned).
      max_clusters: slots for cluster models (>= 1); no split beyond.
      min_split_size: split only clusters with at least this many sampled
        members (>= 2).
      warmup_rounds: no split before this round.
      linkage: "single" (paper's optimal bipartition) or "complete" (code).
      weighting: "samples" (paper) or "uniform" (code) for means of updates.
    """
    if linkage not in LINKAGES:
        raise ValueError(f"linkage must be one of {LINKAGES}, got {linkage!r}")
    check_weighting(weighting)
    cmap = as_client_map(client_map)
    train = make_local_train(model.apply, local)
    hp = CFLHyper(train, eps1, eps2, gamma_max, max_clusters, min_split_size, warmup_rounds, linkage)
    step = client_step(
        functools.partial(client_update, hp), functools.partial(server_update, hp), cmap, own_cluster
    )
    model_bytes = P.tree_bytes(model.template())
    return Algorithm(
        functools.partial(init, model, max_clusters),
        federated_round(
            functools.partial(train_size_loss, step),
            clients_per_round=clients_per_round,
            weighting=weighting,
            bytes_up=model_bytes,
            bytes_down=model_bytes,
        ),
        functools.partial(evaluate, model, cmap, local.loss),
        collaboration_matrix,
        final_report,
    )
