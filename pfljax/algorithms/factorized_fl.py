"""Factorized-FL (Jeong & Hwang, NeurIPS 2022, arXiv:2202.00270).

"Factorized-FL: Personalized Federated Learning with Parameter Factorization &
Similarity Matching". Every kernel is u v^T + mu (`pfljax.models.factorized`):
u is knowledge common to clients, v client-specific, mu a sparse residual
trained with an L1 penalty lambda_sparse * |mu|_1. Each round:

1. the server compares the participants by the cosine similarity sigma of
   their v vectors of one layer (`match_layer`, default the layer before the
   classifier), as last uploaded; client i keeps the clients with
   sigma_ij >= tau (at least `min_keep`, itself always, with sigma_ii = 1) and
   receives its own average of their u with weights softmax(epsilon * sigma)
   over the kept clients (`similarity_weights`);
2. the participants train locally from their personalized model;
3. they upload u of every shared layer and v of the match layer.

v, mu, BatchNorm statistics and (with `head_local`) the classifier stay on the
client; `variant="beta"` also mixes v and mu with the same weights. The
collaboration matrix is the running average of the mixing matrices.

Paper vs released code (wyjeong/Factorized-FL), each a switch here:
- L1 on mu: the paper adds lambda_sparse * |mu|_1 to the loss. Its gradient
  here is lambda_sparse * sign(mu) with sign(0) = 0 (`l1_norm`; jnp.abs would
  give 1 at the zero initialisation). `sparsity="code"` is the release: its
  penalty is computed on `state_dict()` tensors, which are detached, so it adds
  no gradient; instead |mu| < lambda_sparse is zeroed at evaluation.
- Leaves that are neither u, v nor mu (dense biases, BatchNorm scale/offset):
  only u travels in the paper (`other_leaves="local"`); the release averages
  them with the same weights as u (`other_leaves="mixed"`; BatchNorm running
  statistics stay local in both).
- The release mixes over every client that ever uploaded (stale models
  included); here only this round's participants (identical with full
  participation, which the paper's experiments use).
- Order: as in the release, mixing happens when a client is sent its model at
  the start of a round, from the last uploads, and `evaluate` tests each
  client's locally trained model (what the release logs).
- The release's conv kernel layout differs, and its dense mu starts from a
  Glorot draw rather than zero (see `pfljax.models.factorized`).
- Not switches: the release never uploads the classifier and, without label
  permutation, resets it to its initial weights every round; here the head is
  local (`head_local=True`) or mixed like any layer. Its optimizer state
  (momentum) persists across rounds; here it restarts each round, as in every
  pfljax algorithm.

Ablations of the paper's Fig. 8 (options of `build`; the defaults are the method):
- `matching`: whom each client averages u with. "similarity" (the method);
  "fedavg", the factorized model under plain FedAvg: every participant gets the
  same sample-weighted average n_j / sum_k n_k (no similarity, the match layer's
  v is not uploaded; with variant="beta" and other_leaves="mixed" every leaf but
  a local head and BatchNorm statistics is averaged); "random" and "worst"
  change whom a client averages with, not how much: it keeps itself and its
  similarity weights, but the weights of its most similar others go to others
  drawn at random each round / to the least similar ones (`matching_weights`).
  The stored copies of the paper available here do not give Fig. 8's text, so
  these definitions are ours, stated; the released code has no ablation switches.
- `use_mu=False`: no sparse bias: mu is held at zero (zeroed at init, replaced
  by zeros in the forward pass, so it has no gradient), never mixed nor sent.
- sparsity against lambda: `lambda_sparse` (0 trains mu without the L1 term).
  The subgradient does not make mu exactly zero: an entry the data no longer
  pulls on steps across zero by about lr * lambda_sparse (over 1 - momentum
  with momentum) each step, so "sparse" is the release's count (non-zero and
  |mu| >= lambda_sparse, `mu_density`), which is not monotone in a fixed
  threshold at large lambda.
Measured on Fashion-MNIST: experiments/results/factorized_fl_ablations.md.

Scenario settings of the release (tau, epsilon, min_keep): label
heterogeneity (0, 1, 10 permuted / 20 not permuted, of 20 clients), domains
(0.95, 20, 4); lambda_sparse 5e-4, rank 1 (experiments/configs/factorized_fl_*).
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
from pfljax.core.layers import param_order
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.round import Participants, federated_round, map_clients
from pfljax.core.sampling import participation_mask
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model
from pfljax.models.factorized import is_factorized_layer, materialize

VARIANTS = ("base", "beta")
MATCHINGS = ("similarity", "fedavg", "random", "worst")
RANDOM_MATCH_STREAM = 0x4D  # random matching draws from fold_in(sample_key, RANDOM_MATCH_STREAM)
SPARSITY = ("subgradient", "code")
OTHER_LEAVES = ("local", "mixed")
FACTORIZED_MODELS = {
    "mlp": "factorized_mlp",
    "cnn": "factorized_cnn",
    "cnn_bn": "factorized_cnn_bn",
    "resnet9": "factorized_resnet9",
}
# Model names accepted (plain or already factorized) -> the factorized model trained.
MODEL_VARIANTS = {**FACTORIZED_MODELS, **{name: name for name in FACTORIZED_MODELS.values()}}


class FactorizedFLState(NamedTuple):
    client_params: Any  # full variables tree, leaves [C, ...]
    client_mixing_sum: jax.Array  # [C, C] sum over rounds of the mixing matrices
    round: jax.Array


@jax.custom_jvp
def l1_norm(x: jax.Array) -> jax.Array:
    """sum |x|, whose derivative is sign(x) with sign(0) = 0 (a subgradient)."""
    return jnp.sum(jnp.abs(x))


@l1_norm.defjvp
def _l1_norm_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return l1_norm(x), jnp.sum(jnp.sign(x) * t)


def mu_leaves(params: Any) -> list[jax.Array]:
    """The mu leaves of every factorized layer of a params tree."""
    out = []

    def walk(node):
        if is_factorized_layer(node):
            out.append(node["mu"])
        elif isinstance(node, dict):
            for child in node.values():
                walk(child)

    walk(params)
    return out


def sparse_penalty(params: Any, lambda_sparse: float) -> jax.Array:
    """lambda_sparse * sum of |mu|_1 over layers (gradient lambda_sparse * sign(mu))."""
    return lambda_sparse * sum((l1_norm(m) for m in mu_leaves(params)), jnp.float32(0.0))


def prune_mu(variables: Any, threshold: float) -> Any:
    """Zeroes |mu| < threshold (the release's evaluation-time pruning)."""

    def walk(node):
        if is_factorized_layer(node):
            return {**node, "mu": jnp.where(jnp.abs(node["mu"]) < threshold, 0.0, node["mu"])}
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(variables)


def zero_mu(variables: Any) -> Any:
    """`variables` with every mu replaced by zeros (no gradient reaches mu)."""

    def walk(node):
        if is_factorized_layer(node):
            return {**node, "mu": jnp.zeros_like(node["mu"])}
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(variables)


def without_mu(apply_fn: Callable) -> Callable:
    """`apply_fn` on the variables with mu zeroed (`use_mu=False`)."""

    def apply(variables, *args, **kwargs):
        return apply_fn(zero_mu(variables), *args, **kwargs)

    return apply


def similarity_weights(
    v: jax.Array,
    *,
    tau: float,
    epsilon: float,
    min_keep: int,
    participating: jax.Array | None = None,
) -> jax.Array:
    """Factorized-FL's mixing matrix from client-specific vectors.

    sigma_ij = cos(v_i, v_j) (sigma_ii = 1). Client i keeps the participants j
    with sigma_ij >= tau, and at least its `min_keep` most similar ones (itself
    first); weights are softmax(epsilon * sigma_ij) over the kept clients.

    Args:
      v: [C, d] one vector per client (e.g. the flattened v of one layer).
      tau: similarity threshold.
      epsilon: softmax sharpness (>= 0); large values concentrate on the most
        similar clients (sigma = 1: the client itself and exact twins).
      min_keep: minimum number of kept clients (capped by the participants).
      participating: [C] bool; non-participants get zero rows and columns.

    Returns:
      [C, C] float32, non-negative rows summing to 1 for participants, zero
      rows for the others.
    """
    num = v.shape[0]
    v = v.reshape(num, -1).astype(jnp.float32)
    unit = v / jnp.maximum(jnp.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    eye = jnp.eye(num, dtype=bool)
    sigma = jnp.where(eye, 1.0, jnp.clip(unit @ unit.T, -1.0, 1.0))
    part = jnp.ones((num,), bool) if participating is None else participating.astype(bool)
    valid = part[:, None] & part[None, :]
    # Rank of j among i's candidates by decreasing similarity, itself first.
    score = jnp.where(eye, jnp.inf, jnp.where(valid, sigma, -jnp.inf))
    rank = jnp.argsort(jnp.argsort(-score, axis=1, stable=True), axis=1)
    keep = valid & ((sigma >= tau) | (rank < min_keep) | eye)
    # sigma <= 1 = sigma_ii, so exp(epsilon * (sigma - 1)) is a stable softmax numerator.
    scores = jnp.where(keep, jnp.exp(epsilon * (sigma - 1.0)), 0.0)
    total = jnp.sum(scores, axis=1, keepdims=True)
    return jnp.where(total > 0, scores / jnp.where(total > 0, total, 1.0), 0.0)


def fedavg_weights(counts: jax.Array, participating: jax.Array | None = None) -> jax.Array:
    """[C, C] plain FedAvg mixing: every participant's row is n_j / sum_k n_k over
    the participants j (train sizes `counts` [C]); zero rows for the others."""
    num = counts.shape[0]
    part = jnp.ones((num,), bool) if participating is None else participating.astype(bool)
    n = jnp.where(part, counts.astype(jnp.float32), 0.0)
    row = n / jnp.maximum(jnp.sum(n), 1e-12)
    return jnp.where(part[:, None], jnp.broadcast_to(row, (num, num)), 0.0)


def matching_weights(
    v: jax.Array,
    *,
    matching: str,
    tau: float,
    epsilon: float,
    min_keep: int,
    participating: jax.Array | None = None,
    counts: jax.Array | None = None,
    key: jax.Array | None = None,
) -> jax.Array:
    """The mixing matrix of a `matching` rule (the Fig. 8 ablations).

    "similarity": `similarity_weights`. "fedavg": `fedavg_weights(counts)`.
    "random" / "worst" change whom a client averages with, not how much: row i
    holds the same weights as the similarity row (its own weight, then the
    others' in decreasing order), but the k-th largest weight among the others
    goes to the k-th client of a uniformly random order of the other
    participants (drawn with `key`) / of the order of increasing similarity
    (the least similar first). So each client keeps itself, as many clients as
    the similarity rule keeps, and the same weights.

    Args:
      v, tau, epsilon, min_keep, participating: as `similarity_weights`.
      matching: one of MATCHINGS.
      counts: [C] train sizes (for "fedavg").
      key: PRNG key (for "random").

    Returns:
      [C, C] float32, rows summing to 1 for participants, zero rows otherwise.
    """
    if matching not in MATCHINGS:
        raise ValueError(f"matching must be one of {MATCHINGS}, got {matching!r}")
    if matching == "fedavg":
        return fedavg_weights(counts, participating)
    similar = similarity_weights(v, tau=tau, epsilon=epsilon, min_keep=min_keep, participating=participating)
    if matching == "similarity":
        return similar
    num = v.shape[0]
    v = v.reshape(num, -1).astype(jnp.float32)
    unit = v / jnp.maximum(jnp.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    eye = jnp.eye(num, dtype=bool)
    part = jnp.ones((num,), bool) if participating is None else participating.astype(bool)
    valid = part[:, None] & part[None, :]
    # Row i's weights in decreasing order: its own (sigma_ii = 1 is the largest), then the others'.
    ranked = -jnp.sort(-similar, axis=1)
    order = unit @ unit.T if matching == "worst" else jax.random.uniform(key, (num, num))
    # Rank of j among i's participants by increasing `order`, itself first, non-participants last.
    score = jnp.where(eye, -jnp.inf, jnp.where(valid, order, jnp.inf))
    rank = jnp.argsort(jnp.argsort(score, axis=1, stable=True), axis=1)
    return jnp.where(valid, jnp.take_along_axis(ranked, rank, axis=1), 0.0)


def layer_order(model: Model) -> list[str]:
    """Names (e.g. "conv_7", "head") of the factorized layers in call order
    (`pfljax.core.layers.param_order`, keeping the layers with u, v and mu)."""
    params = model.template()["params"]
    return [name for name in param_order(model) if is_factorized_layer(params[name])]


def leaf_roles(
    template: Any,
    match_layer: str,
    *,
    variant: str,
    head_local: bool,
    other_leaves: str,
    use_mu: bool = True,
    upload_match: bool = True,
):
    """Per-leaf booleans (pytrees like `template`): mixed by the server; uploaded.

    Mixed: u (with "beta" also v and, with use_mu, mu) of every layer, plus the
    other "params" leaves with other_leaves="mixed"; never the head with
    head_local, never non-"params" collections. Uploaded: the mixed leaves and,
    with upload_match (every matching but "fedavg"), the match layer's v.
    """
    factor_names = (("u", "v", "mu") if use_mu else ("u", "v")) if variant == "beta" else ("u",)

    def mixed(path, _):
        parts = P.path_str(path).split("/")
        if parts[0] != "params" or (head_local and parts[1] == "head"):
            return False
        if parts[-1] in ("u", "v", "mu"):
            return parts[-1] in factor_names
        return other_leaves == "mixed"

    is_mixed = jax.tree_util.tree_map_with_path(mixed, template)
    match_v = f"params/{match_layer}/v"
    uploaded = jax.tree_util.tree_map_with_path(
        lambda p, _, m: m or (upload_match and P.path_str(p) == match_v), template, is_mixed
    )
    return is_mixed, uploaded


def flagged_bytes(tree: Any, flags: Any) -> int:
    """Bytes of the leaves of `tree` whose flag is True (per client)."""
    return sum(P.tree_bytes(x) for x, f in zip(jax.tree.leaves(tree), jax.tree.leaves(flags)) if f)


class FactorizedFLHyper(NamedTuple):
    """What the pieces of a Factorized-FL round need (see `build` for the options).

    train: the local trainer (with the L1 penalty or not; with use_mu=False on
    the model with mu zeroed); is_mixed: bool tree of the mixed leaves;
    dense_bytes: one unfactorized model (the FedAvg figure); matching: one of
    MATCHINGS.
    """

    train: Callable
    is_mixed: Any
    match_layer: str
    tau: float
    epsilon: float
    min_keep: int
    lambda_sparse: float
    dense_bytes: int
    matching: str = "similarity"
    use_mu: bool = True


def init(
    model: Model, key, params_template=None, num_clients: int = 1, *, use_mu: bool = True
) -> FactorizedFLState:
    params = model.initial(key, params_template)
    params = params if use_mu else zero_mu(params)
    return FactorizedFLState(
        broadcast(params, num_clients),
        jnp.zeros((num_clients, num_clients), jnp.float32),
        jnp.zeros([], jnp.int32),
    )


def match_vectors(match_layer: str, client_params: Any) -> jax.Array:
    """[C, d]: the flattened v of the match layer of every client."""
    v = client_params["params"][match_layer]["v"]
    return v.reshape(v.shape[0], -1)


def mixing_matrix(hp: FactorizedFLHyper, state: FactorizedFLState, part: Participants) -> jax.Array:
    """[C, C] this round's `matching_weights` among the participants (default:
    `similarity_weights` from the last uploaded v of the match layer; "fedavg"
    from the participants' aggregation weights, their train sizes); zero rows
    for the others."""
    counts = jnp.zeros((part.num_clients,), jnp.float32).at[part.ids].set(part.weights)
    return matching_weights(
        match_vectors(hp.match_layer, state.client_params),
        matching=hp.matching,
        tau=hp.tau,
        epsilon=hp.epsilon,
        min_keep=hp.min_keep,
        participating=participation_mask(part.ids, part.num_clients),
        counts=counts,
        key=jax.random.fold_in(part.sample_key, RANDOM_MATCH_STREAM),
    )


def sent_models(hp: FactorizedFLHyper, state: FactorizedFLState, weights, part: Participants):
    """Server: each participant's model [K, ...], its mixed leaves replaced by
    its own weighted average of the last uploads."""
    mixed = jax.tree.map(lambda x, m: aggregate.mix(weights, x) if m else x, state.client_params, hp.is_mixed)
    return part.gather(mixed)


def client_update(hp: FactorizedFLHyper, state: FactorizedFLState, cid, start, data, key):
    """ONE client: local training from the model the server sent it."""
    res = hp.train(start, data, key)
    return res.params, res.loss


def server_update(hp: FactorizedFLHyper, state: FactorizedFLState, trained, weights, part: Participants):
    """Stores the trained models and this round's mixing matrix.

    Metrics: fedavg_bytes_up (FedAvg's upload, the materialized unfactorized
    model, for comparison with bytes_up: u of the mixed layers + v of the match
    layer), kept_clients (mean number of clients a participant averages over),
    mu_density (share of the participants' mu entries that are non-zero and
    have |mu| >= lambda_sparse, i.e. not pruned by the release's rule) and
    mixing ([C, C], this round's matrix).
    """
    new_state = state._replace(
        client_params=part.scatter(state.client_params, trained),
        client_mixing_sum=state.client_mixing_sum + weights,
    )
    kept = jnp.sum(weights > 0, axis=1).astype(jnp.float32)
    mask = participation_mask(part.ids, part.num_clients)
    mus = mu_leaves(trained["params"])
    above = sum(jnp.sum((jnp.abs(m) >= hp.lambda_sparse) & (m != 0)) for m in mus)
    return new_state, {
        "fedavg_bytes_up": jnp.float32(part.k * hp.dense_bytes),
        "kept_clients": jnp.sum(kept * mask) / part.k,
        "mu_density": above.astype(jnp.float32) / sum(m.size for m in mus),
        "mixing": weights,
    }


def step(hp: FactorizedFLHyper, client_map, state: FactorizedFLState, data: ClientData, part: Participants):
    """Server mixes and sends, participants train, server stores."""
    weights = mixing_matrix(hp, state, part)
    starts = sent_models(hp, state, weights, part)
    trained, losses = map_clients(functools.partial(client_update, hp), client_map, state, data, part, starts)
    new_state, metrics = server_update(hp, state, trained, weights, part)
    return new_state, losses, metrics


def evaluate(
    model: Model, client_map, loss, prune: float | None, state: FactorizedFLState, data, key, use_mu=True
):
    """Each client's locally trained model (mu pruned below `prune` if given,
    zeroed without `use_mu`) on its test rows."""

    def variables_of(c):
        params = take(state.client_params, c)
        params = params if use_mu else zero_mu(params)
        return params if prune is None else prune_mu(params, prune)

    return evaluate_clients(model.apply, variables_of, data.test, client_map, loss)


def collaboration_matrix(state: FactorizedFLState) -> jax.Array:
    """[C, C] average mixing weights over the rounds each client took part in
    (rows sum to 1; a client that never took part has weight 1 on itself)."""
    total = state.client_mixing_sum
    rows = jnp.sum(total, axis=1, keepdims=True)
    eye = jnp.eye(total.shape[0], dtype=total.dtype)
    return jnp.where(rows > 0, total / jnp.where(rows > 0, rows, 1.0), eye)


def group_ratio(matrix: np.ndarray, groups: np.ndarray) -> dict:
    """Mean off-diagonal weight within groups, across groups, and their ratio."""
    matrix, groups = np.asarray(matrix, np.float64), np.asarray(groups)
    same = groups[:, None] == groups[None, :]
    off = ~np.eye(len(groups), dtype=bool)
    within = float(matrix[same & off].mean()) if np.any(same & off) else float("nan")
    across = float(matrix[~same].mean()) if np.any(~same) else float("nan")
    ratio = within / across if across > 0 else float("inf")
    return {"collab_within_group": within, "collab_across_group": across, "collab_within_across_ratio": ratio}


def final_report(state: FactorizedFLState, fed_data, per_client=None, key=None) -> dict:
    """Collaboration within vs across client groups, when the data have groups
    (`fed_data.summary["clients"][c]["group"]`); else {}."""
    clients = (getattr(fed_data, "summary", None) or {}).get("clients", [])
    groups = [c.get("group") for c in clients]
    if not groups or any(g is None for g in groups):
        return {}
    return group_ratio(np.asarray(collaboration_matrix(state)), np.asarray(groups))


def check_options(variant: str, sparsity: str, other_leaves: str, matching="similarity", use_mu=True) -> None:
    """ValueError naming the first invalid choice of `build` (numbers: `DOMAINS`)."""
    for name, value, allowed in (
        ("variant", variant, VARIANTS),
        ("sparsity", sparsity, SPARSITY),
        ("other_leaves", other_leaves, OTHER_LEAVES),
        ("matching", matching, MATCHINGS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if not isinstance(use_mu, (bool, np.bool_)):
        raise ValueError(f"use_mu must be True or False, got {use_mu!r}")


def make_train(model: Model, local: LocalTraining, sparsity: str, lambda_sparse, use_mu: bool) -> Callable:
    """The local trainer: with the L1 penalty on mu in the loss (sparsity "subgradient"),
    or without mu (use_mu False: mu held at zero)."""
    use_l1 = sparsity == "subgradient" and use_mu
    regularizer = (lambda p: sparse_penalty(p, lambda_sparse)) if use_l1 else None
    apply_fn = model.apply if use_mu else without_mu(model.apply)
    return make_local_train(apply_fn, local, regularizer=regularizer)


def resolve_match_layer(model: Model, match_layer: str) -> str:
    """The match layer's name: "auto" is the last factorized layer before "head"."""
    layers = layer_order(model)
    if not layers:
        raise ValueError(
            "model has no factorized layer; build one of "
            f"{sorted(set(MODEL_VARIANTS.values()))} (algorithms.model_variant('factorized_fl', name))"
        )
    if match_layer == "auto":
        before_head = [name for name in layers if name != "head"]
        return before_head[-1] if before_head else layers[-1]
    if match_layer not in layers:
        raise ValueError(f"match_layer must be 'auto' or one of {layers}, got {match_layer!r}")
    return match_layer


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "each client keeps a row of [C, C] similarities (O(C) "
    "state per client) and its round matches every client"
)

DOMAINS = {
    "tau": Domain(note="a cosine-similarity threshold; above 1: only the min_keep most similar"),
    "epsilon": Domain(0),
    "min_keep": Domain(1, integer=True),
    "lambda_sparse": Domain(0),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    variant: str = "base",
    match_layer: str = "auto",
    tau: float = 0.0,
    epsilon: float = 1.0,
    min_keep: int = 1,
    lambda_sparse: float = 5e-4,
    head_local: bool = True,
    sparsity: str = "subgradient",
    other_leaves: str = "local",
    matching: str = "similarity",
    use_mu: bool = True,
) -> Algorithm:
    """Factorized-FL on a factorized model (see `MODEL_VARIANTS`).

    Args:
      model: a model with factorized layers (`pfljax.models.factorized`).
      local: local training hyperparameters.
      clients_per_round: K clients sampled per round (None: all).
      client_map: client-axis mapping strategy (see pfljax.core.clients).
      variant: "base" (u mixed) or "beta" (u, v and mu mixed).
      match_layer: layer whose v measures similarity, e.g. "conv_7"; "auto" is
        the last factorized layer before "head" in call order.
      tau: similarity threshold of `similarity_weights`.
      epsilon: softmax sharpness (>= 0).
      min_keep: minimum number of clients each client averages over (>= 1).
      lambda_sparse: weight of the L1 penalty on mu (>= 0).
      head_local: the classifier `head` is never mixed nor sent (labels
        permuted, or domains with their own labels).
      sparsity: "subgradient" (paper) or "code" (release; see module doc).
      other_leaves: "local" (paper) or "mixed" (release) for biases and
        BatchNorm scale/offset.
      matching: "similarity" (the method), or a Fig. 8 ablation: "fedavg"
        (sample-weighted average over all participants, no v uploaded),
        "random" or "worst" (as many clients as similarity keeps, drawn at
        random / the least similar; see `matching_weights`).
      use_mu: False is the "without mu" ablation: mu held at zero, never sent.

    Returns:
      Algorithm; round metrics: the standard ones (bytes_up: u of the mixed layers
      + v of the match layer; bytes_down: the mixed leaves) and `server_update`'s.
    """
    check_options(variant, sparsity, other_leaves, matching, use_mu)
    match_layer = resolve_match_layer(model, match_layer)
    cmap = as_client_map(client_map)
    train = make_train(model, local, sparsity, lambda_sparse, use_mu)
    template = model.template()
    is_mixed, uploaded = leaf_roles(
        template,
        match_layer,
        variant=variant,
        head_local=head_local,
        other_leaves=other_leaves,
        use_mu=use_mu,
        upload_match=matching != "fedavg",
    )
    dense_bytes = P.tree_bytes(jax.eval_shape(materialize, template))
    hp = FactorizedFLHyper(
        train, is_mixed, match_layer, tau, epsilon, min_keep, lambda_sparse, dense_bytes, matching, use_mu
    )
    prune = lambda_sparse if sparsity == "code" and use_mu else None
    return Algorithm(
        functools.partial(init, model, use_mu=use_mu),
        federated_round(
            functools.partial(step, hp, cmap),
            clients_per_round=clients_per_round,
            bytes_up=flagged_bytes(template, uploaded),
            bytes_down=flagged_bytes(template, is_mixed),
        ),
        functools.partial(evaluate, model, cmap, local.loss, prune, use_mu=use_mu),
        collaboration_matrix,
        final_report,
    )
