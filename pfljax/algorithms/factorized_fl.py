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

Scenario settings of the release (tau, epsilon, min_keep): label
heterogeneity (0, 1, 10 permuted / 20 not permuted, of 20 clients), domains
(0.95, 20, 4); lambda_sparse 5e-4, rank 1 (experiments/configs/factorized_fl_*).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pfljax.core import aggregate
from pfljax.core import params as P
from pfljax.core.clients import (
    ClientMap,
    as_client_map,
    broadcast,
    client_key,
    gather,
    round_keys,
    scatter,
    take,
)
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.sampling import check_clients_per_round, participation_mask, sample_clients
from pfljax.core.types import Algorithm, ClientData
from pfljax.models import build_model
from pfljax.models.base import Model
from pfljax.models.factorized import FactorizedConv, FactorizedDense, is_factorized_layer, materialize

VARIANTS = ("base", "beta")
SPARSITY = ("subgradient", "code")
OTHER_LEAVES = ("local", "mixed")
FACTORIZED_MODELS = {
    "mlp": "factorized_mlp",
    "cnn": "factorized_cnn",
    "cnn_bn": "factorized_cnn_bn",
    "resnet9": "factorized_resnet9",
}


class FactorizedFLState(NamedTuple):
    client_params: Any  # full variables tree, leaves [C, ...]
    client_mixing_sum: jax.Array  # [C, C] sum over rounds of the mixing matrices
    round: jax.Array


def prepare_model(name: str, input_shape: tuple, num_outputs: int, **model_kwargs) -> Model:
    """The factorized variant of a model name ("mlp", "cnn", "cnn_bn", "resnet9")."""
    names = sorted(FACTORIZED_MODELS) + sorted(FACTORIZED_MODELS.values())
    if name not in names:
        raise ValueError(f"model must be one of {names} for factorized_fl, got {name!r}")
    return build_model(FACTORIZED_MODELS.get(name, name), input_shape, num_outputs, **model_kwargs)


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


def layer_order(model: Model) -> list[str]:
    """Paths (e.g. "conv_7", "head") of the factorized layers in call order."""
    order = []

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, FactorizedDense | FactorizedConv):
            order.append("/".join(module.path))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):  # a fresh closure: eval_shape caches traces by function
        jax.eval_shape(lambda key: model.init(key), jax.random.key(0))
    return list(dict.fromkeys(order))


def leaf_roles(template: Any, match_layer: str, *, variant: str, head_local: bool, other_leaves: str):
    """Per-leaf booleans (pytrees like `template`): mixed by the server; uploaded.

    Mixed: u (with "beta" also v and mu) of every layer, plus the other
    "params" leaves with other_leaves="mixed"; never the head with head_local,
    never non-"params" collections. Uploaded: the mixed leaves and the match
    layer's v.
    """
    factor_names = ("u", "v", "mu") if variant == "beta" else ("u",)

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
        lambda p, _, m: m or P.path_str(p) == match_v, template, is_mixed
    )
    return is_mixed, uploaded


def flagged_bytes(tree: Any, flags: Any) -> int:
    """Bytes of the leaves of `tree` whose flag is True (per client)."""
    return sum(P.tree_bytes(x) for x, f in zip(jax.tree.leaves(tree), jax.tree.leaves(flags)) if f)


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
) -> Algorithm:
    """Factorized-FL on a factorized model (see `prepare_model`).

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

    Returns:
      Algorithm whose round metrics are train_loss, bytes_up (u of the mixed
      layers + v of the match layer, per participant), bytes_down (the mixed
      leaves), fedavg_bytes_up (FedAvg on the materialized, unfactorized
      model), kept_clients (mean number averaged over), mu_density (share of
      the participants' mu entries with |mu| >= lambda_sparse, i.e. not pruned
      by the release's rule) and mixing ([C, C], this round's matrix).
    """
    for name, value, allowed in (
        ("variant", variant, VARIANTS),
        ("sparsity", sparsity, SPARSITY),
        ("other_leaves", other_leaves, OTHER_LEAVES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if min_keep < 1:
        raise ValueError(f"min_keep must be >= 1, got {min_keep}")
    if lambda_sparse < 0:
        raise ValueError(f"lambda_sparse must be >= 0, got {lambda_sparse}")
    layers = layer_order(model)
    if not layers:
        raise ValueError("model has no factorized layer; build it with factorized_fl.prepare_model")
    if match_layer == "auto":
        before_head = [name for name in layers if name != "head"]
        match_layer = before_head[-1] if before_head else layers[-1]
    if match_layer not in layers:
        raise ValueError(f"match_layer must be 'auto' or one of {layers}, got {match_layer!r}")

    cmap = as_client_map(client_map)
    regularizer = (lambda p: sparse_penalty(p, lambda_sparse)) if sparsity == "subgradient" else None
    train = make_local_train(model.apply, local, regularizer=regularizer)
    template = jax.eval_shape(model.init, jax.random.key(0))
    is_mixed, uploaded = leaf_roles(
        template, match_layer, variant=variant, head_local=head_local, other_leaves=other_leaves
    )
    bytes_up, bytes_down = (flagged_bytes(template, flags) for flags in (uploaded, is_mixed))
    dense_bytes = P.tree_bytes(jax.eval_shape(materialize, template))

    def match_vectors(client_params) -> jax.Array:
        """[C, d]: the flattened v of the match layer of every client."""
        v = client_params["params"]
        for part in match_layer.split("/"):
            v = v[part]
        v = v["v"]
        return v.reshape(v.shape[0], -1)

    def init(key, params_template=None, num_clients: int = 1) -> FactorizedFLState:
        params = model.init(key) if params_template is None else params_template
        return FactorizedFLState(
            broadcast(params, num_clients),
            jnp.zeros((num_clients, num_clients), jnp.float32),
            jnp.zeros([], jnp.int32),
        )

    def round_fn(state: FactorizedFLState, data: ClientData, key):
        num = data.train.count.shape[0]
        k = check_clients_per_round(clients_per_round, num)
        sample_key, train_key = round_keys(key, state.round)
        idx = sample_clients(sample_key, num, k)
        mask = participation_mask(idx, num)
        # Server: each participant's personalized mix of the last uploads.
        v = match_vectors(state.client_params)
        weights = similarity_weights(v, tau=tau, epsilon=epsilon, min_keep=min_keep, participating=mask)

        def send(x, mixed_leaf):
            if not mixed_leaf:
                return x
            return jnp.where(mask.reshape((num,) + (1,) * (x.ndim - 1)), aggregate.mix(weights, x), x)

        start = jax.tree.map(send, state.client_params, is_mixed)

        def client_update(args):
            cid, params_c = args
            res = train(params_c, take(data.train, cid), client_key(train_key, cid))
            return res.params, res.loss

        trained, losses = cmap(client_update, (idx, gather(start, idx)))
        counts = aggregate.normalized_weights(data.train.count[idx])
        new_state = FactorizedFLState(
            scatter(start, idx, trained), state.client_mixing_sum + weights, state.round + 1
        )
        kept = jnp.sum(weights > 0, axis=1).astype(jnp.float32)
        mus = mu_leaves(trained["params"])
        above = sum(jnp.sum(jnp.abs(m) >= lambda_sparse) for m in mus)
        metrics = {
            "train_loss": jnp.sum(counts * losses),
            "bytes_up": jnp.float32(k * bytes_up),
            "bytes_down": jnp.float32(k * bytes_down),
            "fedavg_bytes_up": jnp.float32(k * dense_bytes),
            "kept_clients": jnp.sum(kept * mask) / k,
            "mu_density": above.astype(jnp.float32) / sum(m.size for m in mus),
            "mixing": weights,
        }
        return new_state, metrics

    def evaluate(state: FactorizedFLState, data: ClientData):
        def variables_of(c):
            params = take(state.client_params, c)
            return prune_mu(params, lambda_sparse) if sparsity == "code" else params

        return evaluate_clients(model.apply, variables_of, data.test, cmap, local.loss)

    return Algorithm(init, round_fn, evaluate)


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


def final_report(state: FactorizedFLState, fed_data) -> dict:
    """Collaboration within vs across client groups, when the data have groups
    (`fed_data.summary["clients"][c]["group"]`); else {}."""
    clients = (getattr(fed_data, "summary", None) or {}).get("clients", [])
    groups = [c.get("group") for c in clients]
    if not groups or any(g is None for g in groups):
        return {}
    return group_ratio(np.asarray(collaboration_matrix(state)), np.asarray(groups))
