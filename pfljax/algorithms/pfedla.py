"""pFedLA and HeurpFedLA: layer-wise personalized aggregation learned by hypernetworks.

Ma, Zhang, Guo, Xu, "Layer-wised Model Aggregation for Personalized Federated
Learning", CVPR 2022 (arXiv:2205.03993).

The server keeps every client's latest model theta_j ([C, ...] stacked) and, per
client i, a hypernetwork HN_i(v_i; psi_i) (`pfljax.core.hypernet`, stacked over
clients) with one head per layer group l giving weights alpha_i^l in R^C
(non-negative, summing to 1). Each round, sampled client i starts from
theta_bar_i^l = sum_j alpha_i^{l,j} theta_j^l (`layer_mix`), trains locally and
returns delta_i = theta_i(new) - theta_bar_i. The server stores theta_i(new) and
moves (v_i, psi_i) along the VJP of the aggregation with -delta_i (Eq. 10-11, the
chain rule through the aggregation weights): -delta_i / eta is the client's loss
gradient at theta_bar_i to first order, so this is a descent step on
L_i(theta_bar_i(v_i, psi_i)). One `jax.vjp` covers all K sampled clients.
HeurpFedLA (`top_k` > 0): the k groups with the largest self-weight
alpha_i^{l,i} use one-hot weights (the client keeps its own layer: not
downloaded, no hypernetwork gradient). Uploads stay whole: the server keeps
every client's latest model for the others to mix.

Groups (`pfljax.core.layers.leaf_groups`): "module" (default; a Dense/Conv
kernel and bias together, a BatchNorm scale and offset together) or "tensor" (one
group per leaf, as in FL-bench's pFedLA). BatchNorm running statistics are never
mixed or sent.

The round is `federated_round` with `hypernet.generated_step`: `generate_starts`
(the hypernetworks' weights and the mixing, with its pullback), `client_update`
(local training from the start), `server_update` (store the models, step the
hypernetworks along the pullback of trained - start). `evaluate`: `accuracy` is
client i's personalized aggregate theta_bar_i (what it would download next, as the
public code tests it); `own_accuracy` its latest locally trained model theta_i.

Choices where the public (unofficial) code, KarhouTam/pFedLA and its FL-bench
port, differs or the paper is silent:
- Sign: the code passes +delta as the cotangent and then takes an SGD descent
  step, which is ascent on the client's loss to first order. The default here
  is the descent step above (the sign of pFedHN's official code);
  `hn_sign="code"` reproduces the code (on Fashion-MNIST with hn_lr 0.5 it
  anti-correlates the weights with label overlap and loses 13-66 points).
- Normalization: the code uses ReLU then division by the sum, heads initialised
  kernel U(0, 1), bias 0 (initial weights near uniform), and raises on an
  all-zero row. "relu_normalize" (default) does that, falling back to the
  client's own model on an all-zero row; "softmax" (heads initialised to zero:
  exactly uniform) is the alternative.
- Hypernetwork: embedding 100, three Dense+ReLU layers of 100 (the code's).
- Hypernetwork optimiser (the paper writes the update as a gradient step and
  gives no rate): default Adam, lr 1e-3; the code's plain SGD at lr 5e-3 is
  `hn_optimizer="sgd", hn_lr=5e-3`. Why (experiments/results/pfedla_fmnist_sweep.md,
  Fashion-MNIST non-IID_1, 10 clients, MLP, 40 rounds): an SGD step moves the
  weights by about hn_lr * lambda * |g|, where g_j = <theta_j - theta_bar_i,
  -delta_i> is the weights' gradient and lambda the gain of J J^T (J: d alpha /
  d psi; mean eigenvalue 0.09 at the code's initialisation). |g| grows with the
  local update's size, so the SGD rate that moves the weights depends on the
  local learning rate and epochs. At the code's 5e-3 the weights stay where they
  start: max |alpha - alpha_init| 0.003 after 40 rounds (0.010 after 200),
  Spearman with label overlap -0.04, accuracy that of FedAvg (76.5 vs 76.5); the
  same with the public code's CNN sizes on an H100 (weights within [0.074,
  0.125] for 36 rounds), and in the public code itself (a reported run of it, not
  repeated here: REPRODUCTION.md). SGD at 0.5 moves them at local lr 0.05 (mean
  move 0.058, Spearman 0.58) but barely at local lr 0.01
  (0.009) and collapses to Local training at 5 local epochs (mean self-weight
  0.82). Adam's step does not scale with |g|: at 1e-3 the mean move after 40
  rounds is 0.030-0.033 and the Spearman 0.66-0.71 at all three local scales.
  Longer runs drift towards the client's own model under every setting that
  moves (the gradient is that of the client's own training loss; a weight that
  reaches 0 under relu_normalize never comes back): Adam 1e-3 self-weight 0.17
  at round 40, 0.52 at 100, 0.87 at 200.
  `final_report` reports how far the weights moved (alpha_max_move, ...), so a
  run whose weights stayed put is visible in summary.json.
- Clients sampled in one round are processed together from the round's start
  models; the code processes them one after another, later clients already
  mixing earlier clients' new models. Top-k ranks the normalized self-weights
  (the code ranks the ReLU outputs before normalization). All clients start
  from one initial model (the first code draws one init per client).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pfljax.core import hypernet
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked, known_zero
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.layers import LEAF_GROUPINGS, leaf_groups
from pfljax.core.local import LocalTraining, make_local_train
from pfljax.core.round import Participants, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

PyTree = Any
HIGHEST = jax.lax.Precision.HIGHEST
NORMALIZATIONS = ("relu_normalize", "softmax")
HN_OPTIMIZERS = ("sgd", "adam")
HN_SIGNS = ("descent", "code")
HEAD_INITS = ("auto",) + hypernet.INITS


class PFedLAState(NamedTuple):
    """client_params: [C, ...] each client's latest variables (BN stats included);
    client_hn / client_hn_opt: [C, ...] hypernetwork params and optimizer state;
    client_alpha: [C, L, C] current layer-wise weights alpha_i^{l,j} (after top-k);
    client_alpha_init: [C, L, C] the weights of the initial hypernetworks (for
    `final_report`: how far the weights moved)."""

    client_params: Any
    client_hn: dict
    client_hn_opt: Any
    client_alpha: jax.Array
    client_alpha_init: jax.Array
    round: jax.Array


class PFedLAHyper(NamedTuple):
    """What the pieces need: the local trainer, the layer groups (a tree of ids, their
    names and [L] bytes), the hypernetwork (`hypernet(C)`), its weights' options and
    optimizer, the update's sign and the traced client."""

    train: Callable
    groups: Any
    names: tuple[str, ...]
    group_bytes: np.ndarray
    hypernet: Callable[[int], hypernet.HyperNet]
    normalization: str
    top_k: int
    optimizer: optax.GradientTransformation
    hn_sign: str
    trace_client: int


def layer_mix(alpha: jax.Array, client_params: PyTree, groups: PyTree) -> PyTree:
    """Personalized layer-wise aggregates: out[k]^l = sum_n alpha[k, l, n] x[n]^l.

    Args:
      alpha: [K, L, N] weights of K targets over N clients, per layer group.
      client_params: pytree with leaves [N, ...].
      groups: pytree like one client's params, an int group id per leaf
        (`pfljax.core.layers.leaf_groups`).

    Returns:
      pytree with leaves [K, ...], one einsum per leaf (leaves flattened to [N, P]
      first: its transpose, the weights' gradient, is then a plain matmul, 1.7x
      faster on CPU than contracting the original axes).
    """

    def one(g, x):
        flat = x.reshape(x.shape[0], -1)
        out = jnp.einsum("kn,np->kp", alpha[:, g], flat, precision=jax.lax.Precision.HIGHEST)
        return out.reshape((alpha.shape[0],) + x.shape[1:])

    return jax.tree.map(one, groups, client_params)


MIX_CHUNK_BYTES = 1 << 20  # about this many bytes of the [N, chunk] models per chunk


def _chunked(fn: Callable, init: jax.Array, x: jax.Array, ref: jax.Array, hold: bool = False):
    """Folds fn(acc, x[:, cols] - ref[cols], cols, fresh) over column chunks of x [N, P]
    (the last chunk ends at P and overlaps the one before: `fresh` [width] marks the
    columns no earlier chunk covered). One chunk, no loop, when P is small.
    `hold`: returns (acc, x), x held through the loop where there is one (an optimization
    barrier keeps JAX from forwarding it), so that what writes into it is ordered after
    the loop and XLA need not copy x (see `generate_starts`)."""
    n, p = x.shape
    width = min(p, max(8, MIX_CHUNK_BYTES // (4 * n)))
    chunks = -(-p // width)
    barrier = jax.lax.optimization_barrier if hold and chunks > 1 else lambda held: held

    def body(carry, i):
        acc, held = carry
        start = jnp.minimum(i * width, p - width)
        cols = (start, width)
        diff = jax.lax.dynamic_slice_in_dim(held, *cols, 1) - jax.lax.dynamic_slice_in_dim(ref, *cols)[None]
        acc = fn(acc, diff, cols, start + jnp.arange(width) >= i * width)
        return (acc, barrier(held)), None

    acc, held = jax.lax.scan(body, (init, x), jnp.arange(chunks))[0]
    return (acc, held) if hold else acc


def diff_mix(a: jax.Array, x: jax.Array, ref: jax.Array) -> jax.Array:
    """ref + a @ (x - ref): a [K, N], x [N, P], ref [P] -> [K, P], chunked over P."""

    def one(out, diff, cols, fresh):
        del fresh  # an overlapping column is written again with the same value
        mixed = jax.lax.dynamic_slice_in_dim(ref, *cols)[None] + jnp.dot(a, diff, precision=HIGHEST)
        return jax.lax.dynamic_update_slice_in_dim(out, mixed, cols[0], 1)

    return _chunked(one, jnp.zeros((a.shape[0], x.shape[1]), x.dtype), x, ref)


class Difference(NamedTuple):
    """a - b of two trees (or arrays) of one shape, formed where it is used, chunk by chunk."""

    a: Any
    b: Any


def _cols(t, cols: tuple) -> jax.Array:
    """Columns cols = (start, width) of t [K, P], or of a - b for t = Difference(a, b)."""
    if isinstance(t, Difference):
        return _cols(t.a, cols) - _cols(t.b, cols)
    return jax.lax.dynamic_slice_in_dim(t, *cols, axis=1)


def diff_dots(d, x: jax.Array, ref: jax.Array, hold: bool = False):
    """d @ (x - ref)^T: d [K, P] (or a `Difference` of two), x [N, P], ref [P] -> [K, N],
    chunked over P (`hold`: and x, held through the loop, as in `_chunked`)."""
    k = jax.tree.leaves(d)[0].shape[0]

    def one(acc, diff, cols, fresh):
        part = jnp.where(fresh[None], _cols(d, cols), 0.0)
        return acc + jnp.dot(part, diff.T, precision=HIGHEST)

    return _chunked(one, jnp.zeros((k, x.shape[0]), x.dtype), x, ref, hold)


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1)


def mix_from_ref(alpha: jax.Array, client_params: PyTree, ref: PyTree, groups: PyTree) -> PyTree:
    """`layer_mix` written ref + sum_n alpha[k, l, n] (x[n]^l - ref^l): alpha [K, L, N],
    client_params [N, ...], ref one client's params -> [K, ...]."""

    def one(g, x, r):
        return diff_mix(alpha[:, g], _flat(x), r.reshape(-1)).reshape((alpha.shape[0],) + x.shape[1:])

    return jax.tree.map(one, groups, client_params, ref)


def mix_cotangent(ct: PyTree, client_params: PyTree, ref: PyTree, groups: PyTree, shape, hold: bool = False):
    """The cotangent [K, L, N] of `mix_from_ref`'s alpha for the cotangent `ct` [K, ...] of
    its output (or a `Difference` of two such trees, never stored): entry (k, l, n) sums
    <ct[k]^leaf, x[n]^leaf - ref^leaf> over group l's leaves.
    `hold`: returns (cotangent, client_params held through the loops, as in `_chunked`)."""
    if isinstance(ct, Difference):
        cts = [Difference(_flat(a), _flat(b)) for a, b in zip(*map(jax.tree.leaves, ct))]
    else:
        cts = [_flat(c) for c in jax.tree.leaves(ct)]
    out, held = jnp.zeros(shape, jnp.float32), []
    for g, x, r, c in zip(*(jax.tree.leaves(t) for t in (groups, client_params, ref)), cts):
        dots = diff_dots(c, _flat(x), r.reshape(-1), hold)
        dots, x = (dots[0], dots[1].reshape(x.shape)) if hold else (dots, x)
        out, held = out.at[:, g].add(dots), held + [x]
    return (out, jax.tree.unflatten(jax.tree.structure(client_params), held)) if hold else out


def normalize_weights(raw: jax.Array, self_index: jax.Array, how: str) -> jax.Array:
    """Raw head outputs [L, N] -> weights [L, N], rows non-negative summing to 1.

    "softmax", or "relu_normalize": ReLU then divide by the row sum; an all-zero
    row falls back to one-hot on `self_index` (the client's own layer).
    """
    if how == "softmax":
        return jax.nn.softmax(raw, axis=-1)
    pos = jax.nn.relu(raw)
    total = jnp.sum(pos, axis=-1, keepdims=True)
    own = jax.nn.one_hot(self_index, raw.shape[-1], dtype=raw.dtype)[None]
    return jnp.where(total > 0, pos / jnp.where(total > 0, total, 1.0), own)


def retain_top_k(alpha: jax.Array, self_index: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """HeurpFedLA: the k groups with the largest self-weight alpha[l, self] become
    one-hot on self (no gradient flows to them). Returns (alpha [L, N], retained [L])."""
    num_groups, n = alpha.shape
    if k == 0:
        return alpha, jnp.zeros((num_groups,), bool)
    _, top = jax.lax.top_k(jax.lax.stop_gradient(alpha[:, self_index]), k)
    retained = jnp.zeros((num_groups,), bool).at[top].set(True)
    own = jax.nn.one_hot(self_index, n, dtype=alpha.dtype)[None]
    return jnp.where(retained[:, None], own, alpha), retained


def collaboration_matrix(state: PFedLAState) -> jax.Array:
    """[C, C]: alpha averaged over layer groups (row i: whom client i aggregates)."""
    return jnp.mean(state.client_alpha, axis=1)


def label_overlap(fed_data) -> np.ndarray | None:
    """[C, C] overlap of the clients' train label distributions, sum_k min(p_i(k), p_j(k))
    (1 on the diagonal; for clients holding 4 equally frequent classes each, about
    shared classes / 4). None for regression data or without data."""
    data = getattr(fed_data, "data", None)
    if data is None or getattr(fed_data, "task", "classification") != "classification":
        return None
    labels = data.train.client_labels()
    if any(y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) for y in labels):
        return None
    top = max((int(y.max()) + 1 for y in labels if len(y)), default=0)
    classes = max(int(getattr(fed_data, "num_classes", 0) or 0), top)
    hist = np.stack([np.bincount(y, minlength=classes) for y in labels]).astype(float)
    p = hist / np.maximum(hist.sum(1, keepdims=True), 1.0)
    return np.minimum(p[:, None, :], p[None, :, :]).sum(-1)


def average_ranks(x) -> np.ndarray:
    """Ranks 1..n of x, tied values sharing their mean rank."""
    x = np.asarray(x, np.float64).ravel()
    order = np.argsort(x, kind="stable")
    ordinal = np.empty(len(x))
    ordinal[order] = np.arange(1, len(x) + 1)
    _, tie, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(tie, weights=ordinal)
    return sums[tie] / counts[tie]


def spearman(a, b) -> float:
    """Spearman rank correlation with average ranks for ties (nan if either is constant)."""
    ra, rb = average_ranks(a), average_ranks(b)
    if np.ptp(ra) == 0 or np.ptp(rb) == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def final_report(state: PFedLAState, fed_data=None, per_client=None, key=None) -> dict:
    """How far the aggregation weights moved, so that a run whose weights stayed
    where they started (FedAvg with a fixed mixing) is visible in summary.json.

    alpha_max_move / alpha_mean_move: max / mean |alpha - alpha_init| over all
    clients, layer groups and sources (alpha after top-k; alpha_init: the initial
    hypernetworks' weights); alpha_max_dev_from_uniform (and _init): max |alpha -
    1/C| now (and at initialisation); alpha_mean_self_weight: mean alpha_i^{l,i};
    alpha_spearman_label_overlap (classification data, C > 2, defined): Spearman
    correlation, over pairs i != j, of the layer-averaged weight of j in i's
    aggregate with the overlap of their train label distributions (`label_overlap`).
    `per_client` and `key` are unused.
    """
    del per_client, key
    alpha = np.asarray(state.client_alpha, np.float64)
    init = np.asarray(state.client_alpha_init, np.float64)
    num = alpha.shape[-1]
    move = np.abs(alpha - init)
    out = {
        "alpha_max_move": float(move.max()),
        "alpha_mean_move": float(move.mean()),
        "alpha_max_dev_from_uniform": float(np.abs(alpha - 1.0 / num).max()),
        "alpha_init_max_dev_from_uniform": float(np.abs(init - 1.0 / num).max()),
        "alpha_mean_self_weight": float(np.mean(alpha[np.arange(num), :, np.arange(num)])),
    }
    overlap = label_overlap(fed_data)
    if overlap is not None and overlap.shape == (num, num) and num > 2:
        off = ~np.eye(num, dtype=bool)
        rho = spearman(alpha.mean(1)[off], overlap[off])
        if np.isfinite(rho):
            out["alpha_spearman_label_overlap"] = rho
    return out


def make_hypernet(
    names: tuple[str, ...], embedding_dim: int, hidden: tuple[int, ...], head_init: str, num_clients: int
) -> hypernet.HyperNet:
    """One client's hypernetwork: one head of C raw weights per layer group."""
    return hypernet.mlp_hypernet(
        {name: num_clients for name in names},
        embedding_dim=embedding_dim,
        hidden=hidden,
        relu_last=True,
        trunk_init="torch",
        head_init=head_init,
    )


def aggregation_weights(
    raw: jax.Array, client: jax.Array, normalization: str = "softmax", top_k: int = 0
) -> tuple[jax.Array, jax.Array]:
    """pFedLA's layer-wise aggregation weights of `client` from its hypernetwork's raw
    outputs [L, C] (one row per layer group): `normalize_weights`, then HeurpFedLA's
    `retain_top_k` (top_k 0: pFedLA). Returns (alpha [L, C], retained [L])."""
    if jnp.ndim(raw) != 2 or not 0 <= top_k <= jnp.shape(raw)[0]:
        raise ValueError(
            f"aggregation_weights: raw [L, C] (layer groups x clients) and top_k in [0, L] expected, "
            f"got raw {jnp.shape(raw)}, top_k={top_k}"
        )
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"aggregation_weights: normalization must be one of {NORMALIZATIONS}, got {normalization!r}"
        )
    return retain_top_k(normalize_weights(raw, client, normalization), client, top_k)


def layer_weights(hp: PFedLAHyper, hn_params: dict, cid: jax.Array, num_clients: int):
    """Client cid's weights alpha [L, C] from its hypernetwork, and the groups it retains [L]."""
    out = hp.hypernet(num_clients).apply(hn_params, 0)
    raw = jnp.stack([out[name] for name in hp.names])
    return aggregation_weights(raw, cid, hp.normalization, hp.top_k)


def participant_layer_weights(hp: PFedLAHyper, hn_rows: dict, part: Participants):
    """(alpha [K, L, C], retained [K, L]) of the participants' hypernetworks [K, ...]."""
    return jax.vmap(lambda hn, c: layer_weights(hp, hn, c, part.num_clients))(hn_rows, part.ids)


def init_server(hp: PFedLAHyper, params: PyTree, key: jax.Array, num_clients: int) -> PFedLAState:
    """Every client at `params`, C fresh hypernetworks and their weights."""
    hn = hypernet.init_stacked(hp.hypernet(num_clients), key, num_clients)
    alpha = jax.vmap(lambda p, c: layer_weights(hp, p, c, num_clients)[0])(hn, jnp.arange(num_clients))
    return PFedLAState(
        broadcast(params, num_clients),
        hn,
        jax.vmap(hp.optimizer.init)(hn),
        alpha,
        alpha,
        jnp.zeros([], jnp.int32),
    )


def init(hp: PFedLAHyper, model: Model, init_jit: Callable, key, params_template=None, num_clients: int = 1):
    """`init_jit` is `init_server` bound to hp and jitted (num_clients static)."""
    if hp.trace_client >= num_clients:
        raise ValueError(f"trace_client must be < num_clients={num_clients}, got {hp.trace_client}")
    params = model.initial(key, params_template)  # as fedavg
    return init_jit(params, jax.random.fold_in(key, 0x4E), num_clients)


def generate_starts(hp: PFedLAHyper, state: PFedLAState, part: Participants):
    """The participants' starts theta_bar [K, ...] (their weights mixing all C models),
    and the pullback to their hypernetworks [K, ...] (row k only reaches start k).

    The mix is written theta_0 + sum_j alpha_j (theta_j - theta_0) (equal to sum_j
    alpha_j theta_j: every row of alpha sums to 1), so the weights' gradient
    <theta_j - theta_0, -delta> is computed from the models' differences, without the
    cancellation of their large common part: it is exactly 0 when all models are equal
    (round 1), where <theta_j, -delta> would leave rounding noise that Adam, which
    normalises the gradient's scale, turns into a full-size step. The differences are
    formed chunk by chunk (`diff_mix`, `diff_dots`), never as a [C, ...] tree; the
    weights' cotangent is written out (`mix_cotangent`) and pulled back through the
    hypernetworks with one `jax.vjp`, as `hypernet.vjp_generate` would.
    `delta` may be a `Difference` (trained - starts, `server_update`): it is then formed
    chunk by chunk too, never stored. `grad_of(delta, hold=True)` also returns the client
    models ("params") held through the pullback's loops: written into after it, a donated
    state is then updated in place (otherwise XLA copies all C models twice: once for the
    loops, once more as the pullback could run after the write).
    """
    all_params = state.client_params["params"]
    ref = jax.tree.map(lambda x: x[0], all_params)
    weights = lambda hn_rows: participant_layer_weights(hp, hn_rows, part)[0]  # noqa: E731
    alpha, pullback = jax.vjp(weights, part.gather(state.client_hn))

    def grad_of(delta, hold=False):
        neg = isinstance(delta, Difference)
        ct = Difference(delta.b, delta.a) if neg else jax.tree.map(jnp.negative, delta)
        cotangent = mix_cotangent(ct, all_params, ref, hp.groups, alpha.shape, hold)
        if not hold:
            return pullback(cotangent)[0]
        return pullback(cotangent[0])[0], cotangent[1]

    return mix_from_ref(alpha, all_params, ref, hp.groups), grad_of


def client_update(hp: PFedLAHyper, state: PFedLAState, cid, start, data, key):
    """ONE client: its own non-"params" collections with its start, trained locally.
    Returns the trained variables and the loss."""
    rest = take({name: v for name, v in state.client_params.items() if name != "params"}, cid)
    res = hp.train({**rest, "params": start}, data, key)
    return res.params, res.loss


def server_update(hp: PFedLAHyper, state: PFedLAState, trained, part: Participants, grad_of, starts):
    """Stores the trained models; steps each participant's hypernetwork along the
    pullback of its -delta (+delta with hn_sign="code"), delta = trained params - start
    (`starts` [K, ...], formed in the pullback), and recomputes its weights."""
    delta = Difference(trained["params"], starts)
    if hp.hn_sign == "code":
        delta = Difference(starts, trained["params"])
    hn_rows, opt_rows = part.gather(state.client_hn), part.gather(state.client_hn_opt)
    alpha, retained = participant_layer_weights(hp, hn_rows, part)
    grads, held = grad_of(delta, hold=True)
    step = lambda p, o, g: hypernet.apply_grads(hp.optimizer, p, o, g)  # noqa: E731
    hn, hn_opt = jax.vmap(step)(hn_rows, opt_rows, grads)
    client_alpha = state.client_alpha.at[part.ids].set(participant_layer_weights(hp, hn, part)[0])
    new_state = state._replace(
        client_params=part.scatter({**state.client_params, "params": held}, trained),
        client_hn=part.scatter(state.client_hn, hn),
        client_hn_opt=part.scatter(state.client_hn_opt, hn_opt),
        client_alpha=client_alpha,
    )
    return new_state, round_metrics(hp, alpha, retained, part, client_alpha)


def round_metrics(hp: PFedLAHyper, alpha, retained, part: Participants, client_alpha) -> dict:
    """Round-start mean self-weight and retained groups, bytes downloaded (retained
    groups are not), and the traced client's new weights [L, C]."""
    self_w = alpha[jnp.arange(part.k), :, part.ids]
    return {
        "bytes_down": jnp.sum(jnp.where(retained, 0.0, hp.group_bytes[None])),
        "self_weight": jnp.mean(self_w),
        "retained_groups": jnp.mean(jnp.sum(retained, axis=1).astype(jnp.float32)),
        "trace_alpha": client_alpha[hp.trace_client],
    }


def evaluate(hp: PFedLAHyper, model: Model, client_map, loss, state: PFedLAState, data: ClientData, key):
    """`accuracy`/`loss`: each client's aggregate theta_bar_i; `own_*`: its latest model
    (deterministic: `key` is unused)."""
    del key
    mixed = layer_mix(state.client_alpha, state.client_params["params"], hp.groups)  # [C, ...]
    personalized = {**state.client_params, "params": mixed}
    out = evaluate_clients(model.apply, lambda c: take(personalized, c), data.test, client_map, loss)
    latest = lambda c: take(state.client_params, c)  # noqa: E731
    own = evaluate_clients(model.apply, latest, data.test, client_map, loss)
    return {**out, "own_accuracy": own["accuracy"], "own_loss": own["loss"]}


def group_bytes(params: PyTree, groups: PyTree, num_groups: int) -> np.ndarray:
    """[L] float32 bytes of each layer group."""
    sizes = [0] * num_groups
    for g, leaf in zip(jax.tree.leaves(groups), jax.tree.leaves(params)):
        sizes[g] += P.tree_bytes(leaf)
    return np.asarray(sizes, np.float32)


def _hn_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
    if name == "adam":
        return optax.adam(lr)
    return optax.sgd(lr, momentum=None if known_zero(momentum) else momentum)


def _check_choices(**choices) -> None:
    """ValueError unless each {name: (value, allowed)} has its value allowed."""
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def make_hyper(
    model: Model,
    local: LocalTraining,
    top_k: int,
    grouping: str,
    normalization: str,
    embedding_dim: int,
    hn_hidden: tuple[int, ...],
    head_init: str,
    hn_optimizer: str,
    hn_lr: float,
    hn_momentum: float,
    hn_sign: str,
    trace_client: int,
) -> PFedLAHyper:
    """Validates `build`'s options and binds them (layer groups of the model's params)."""
    _check_choices(
        grouping=(grouping, LEAF_GROUPINGS),
        normalization=(normalization, NORMALIZATIONS),
        head_init=(head_init, HEAD_INITS),
        hn_optimizer=(hn_optimizer, HN_OPTIMIZERS),
        hn_sign=(hn_sign, HN_SIGNS),
    )
    template = model.template()["params"]
    groups, names = leaf_groups(template, grouping)
    if top_k > len(names):
        raise ValueError(f"top_k must be in [0, {len(names)}] (layer groups {names}), got {top_k}")
    if not hn_hidden:
        raise ValueError(f"hn_hidden must be a non-empty tuple of widths, got {hn_hidden}")
    if head_init == "auto":
        head_init = "uniform01" if normalization == "relu_normalize" else "zeros"
    return PFedLAHyper(
        make_local_train(model.apply, local),
        groups,
        names,
        group_bytes(template, groups, len(names)),
        functools.partial(make_hypernet, names, embedding_dim, hn_hidden, head_init),
        normalization,
        top_k,
        _hn_optimizer(hn_optimizer, hn_lr, hn_momentum),
        hn_sign,
        trace_client,
    )


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "its hypernetwork holds one embedding per client and mixes every client's model with [C, C] layer weights"
)

DOMAINS = {
    "top_k": Domain(0, integer=True, note="0: pFedLA; at most the model's layer groups"),
    "embedding_dim": Domain(1, integer=True),
    "hn_hidden": Domain(1, integer=True, note="each width"),
    "hn_lr": Domain(0, low_open=True),
    "hn_momentum": Domain(0, 1, high_open=True),
    "trace_client": Domain(0, integer=True, note="below num_clients"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    top_k: int = 0,
    grouping: str = "module",
    normalization: str = "relu_normalize",
    embedding_dim: int = 100,
    hn_hidden: tuple[int, ...] = (100, 100, 100),
    head_init: str = "auto",
    hn_optimizer: str = "adam",
    hn_lr: float = 1e-3,
    hn_momentum: float = 0.0,
    hn_sign: str = "descent",
    trace_client: int = 0,
) -> Algorithm:
    """pFedLA (top_k=0) or HeurpFedLA (top_k > 0).

    Args:
      model: the client model.
      local: local training hyperparameters.
      clients_per_round: K clients sampled per round (None: all).
      client_map: client-axis mapping strategy (see pfljax.core.clients).
      top_k: HeurpFedLA's number of layer groups kept local per round (0: pFedLA).
      grouping: "module" or "tensor" (see `pfljax.core.layers.leaf_groups`).
      normalization: "relu_normalize" or "softmax" (see `normalize_weights`).
      embedding_dim: size of each client's embedding v_i.
      hn_hidden: widths of the hypernetwork's Dense+ReLU trunk.
      head_init: hypernet.INITS or "auto" ("uniform01" for relu_normalize,
        "zeros" for softmax: initial weights near or exactly uniform).
      hn_optimizer: "adam" (default, lr 1e-3) or "sgd" (the public code's, with
        hn_lr 5e-3 there; its step scales with the local updates and leaves the
        weights nearly fixed at that rate: see the module doc), with hn_lr and
        (sgd) hn_momentum.
      hn_sign: "descent" (default) or "code" (cotangent +delta, see module doc).
      trace_client: whose per-layer weights [L, C] go to the `trace_alpha` metric.
    """
    hp = make_hyper(
        model, local, top_k, grouping, normalization, embedding_dim, hn_hidden, head_init,
        hn_optimizer, hn_lr, hn_momentum, hn_sign, trace_client,
    )  # fmt: skip
    cmap = as_client_map(client_map)
    template = model.template()["params"]
    step = hypernet.generated_step(
        functools.partial(generate_starts, hp),
        functools.partial(client_update, hp),
        functools.partial(server_update, hp),
        cmap,
    )
    return Algorithm(
        functools.partial(init, hp, model, jax.jit(functools.partial(init_server, hp), static_argnums=2)),
        federated_round(step, clients_per_round=clients_per_round, bytes_up=float(P.tree_bytes(template))),
        functools.partial(evaluate, hp, model, cmap, local.loss),
        collaboration_matrix=collaboration_matrix,
        final_report=final_report,
    )
