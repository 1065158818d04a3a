"""FedeRiCo: decentralized EM over the right collaborators.

Sui, Wen, Lau, Ross & Cresswell, "Find Your Friends: Personalized Federated
Learning with the Right Collaborators", NeurIPS 2022 Workshop on Federated
Learning (arXiv 2210.06597). No released code was found, so this module follows
the paper's text.

There is no central model. Client i owns a model theta_i and a posterior w_i
[C] over the C clients' models (which models explain its data). Each round,
every participating client i:

1. samples n neighbours epsilon-greedily (`sample_neighbours`): with
   probability epsilon n other clients uniformly at random, else the n with the
   largest w_ij; itself always included, so it holds n + 1 models;
2. E-step (`e_step`): evaluates each held model theta_j on its own training
   data (one minibatch, or all rows with `estep_data="full"`) and updates a
   loss estimate L_hat_ij -- an exponential moving average, (1 - beta) L_hat +
   beta * loss (`accumulate="ema"`, the paper's default), or a running sum
   (`accumulate="cumulative"`, the EM recursion with the previous posterior as
   prior, the paper's Sec. 4.4 comparison); w_i = softmax(-L_hat_i) over the
   models it has evaluated (`pfljax.core.mixture.posterior`). The loss is the
   data's negative log-likelihood, summed over the client's samples (estimated
   as n_i times the minibatch mean, `loss_scale="sum"`); `loss_scale="mean"`
   uses the mean instead;
3. M-step (`m_step`): model theta_j takes an optimizer step (`local.optimizer`,
   Adam in the paper) along g_j = sum over clients i holding j of
   w_ij grad L_i(theta_j), each gradient computed by client i on its minibatch
   and sent to j's owner (`combine_gradients`: a segment sum over pairs). The
   round takes S such steps (S = local.steps, or local.epochs epochs of
   minibatches), each on the current models; a model steps only if it received
   positive total weight. `m_step="mean"` (not in the paper) divides g_j by that
   total weight, for optimizers that are not scale-invariant (plain SGD).
   Measured on Fashion-MNIST, 10 clients x 4 classes, SGD 1e-2, 100 rounds,
   3 seeds: "sum" diverged (23.2%), "mean" 89.9%; Adam 1e-3 with "sum" 90.9%.

Prediction for client i is the mixture sum_j w_ij p(y | x; theta_j)
(classification: log of the mixed class probabilities; regression: the
w-weighted mean output; `pfljax.core.mixture.predict`), over all C models or
the `mixture_size` largest weights (renormalised). `evaluate` also reports each
client's own model (`own_accuracy`, `own_loss`).

Metrics per round: `train_loss` (participants' posterior-weighted minibatch
loss, mean over the M-steps), `bytes_down` / `bytes_up` (each participant
receives its n neighbours' models and sends back n gradients at each of the S
M-steps: down K * n * S * model bytes (the whole variables tree), up
K * n * S * gradient bytes (the "params" collection only)), `participants`,
`self_weight` (mean w_ii), `posterior_entropy` (mean), and `posterior` [C, C]
(a per-round trace for the paper's Fig. 3-style plot). The Algorithm's
`collaboration_matrix` is the posterior averaged over rounds; its
`final_report` adds own-group mass and group purity when the data has client
groups.

The round is a custom step of `pfljax.core.round.federated_round`, which
samples the K participants and the keys. The participants' minibatches of all
S M-steps are drawn first (`round_batches`, one epoch order per epoch), then the
E-step (`initial_estimate`: the losses on the first minibatches, or on all rows),
so the posterior weights are known before the M-steps. All (client, neighbour)
pairs of a round, K * (n + 1) of them (`round_pairs`), are computed in one mapped
call per M-step (`pair_step`): the pair function indexes the neighbour's model
inside the map (under "vmap" this gathers [K * (n + 1), ...] model copies; under
"map" each pair slices one model, no copy). Under "map" (one client at a time,
the CPU default) each pair's weighted gradient is added to its model's row as it
comes; otherwise the per-pair gradients [K * (n + 1), ...] are weighted and
scatter-added to their models with `jax.ops.segment_sum` (the same sums, in the
same order).

Choices the paper leaves open (documented, configurable where it matters):
a model's loss estimate starts at its first observed loss and models a
client has not evaluated yet get weight 0 (`initial_loss="first"`; "zero"
starts every estimate at 0, which makes unevaluated models look perfect: with
the summed loss, sampled models then get weight ~0 and nothing trains in round
1); estimates of models a client did not sample this round are left unchanged;
every client initialises its own model (`shared_init=False`: identical models
are a fixed point of the EM, see `build`); non-"params" collections (BatchNorm
statistics) of a model are updated by its owner's own forward passes only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pfljax.core import mixture
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, gather, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import client_sums, max_rows, means, score_sums
from pfljax.core.local import LocalTraining, batch_schedule, num_scan_steps
from pfljax.core.losses import Loss, get_loss, masked_mean
from pfljax.core.round import Participants, federated_round
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

LOSS_SCALES = ("sum", "mean")
ACCUMULATE = ("ema", "cumulative")
ESTEP_DATA = ("batch", "full")
INITIAL_LOSSES = ("first", "zero")
M_STEPS = ("sum", "mean")


class FedericoState(NamedTuple):
    """State of FedeRiCo.

    Attributes:
      client_params: [C, ...] every client's model (flax variables).
      client_opt_state: [C, ...] optimizer state of every model.
      client_losses: [C, C] loss estimates L_hat[i, j] of model j on client i.
      client_seen: [C, C] bool, client i has evaluated model j (all True with
        initial_loss="zero").
      client_posterior: [C, C] w[i, j] = softmax(-L_hat[i])[j] over seen models.
      client_posterior_mean: [C, C] mean of the posteriors after each round so
        far (the collaboration matrix; the initial uniform one before round 1).
      round: int32 rounds done.
    """

    client_params: Any
    client_opt_state: Any
    client_losses: jax.Array
    client_seen: jax.Array
    client_posterior: jax.Array
    client_posterior_mean: jax.Array
    round: jax.Array


class FedericoHyper(NamedTuple):
    """The options of `build` the pieces of a round read (see `build`), with the
    model, its loss, the client map and the model's / gradient's bytes."""

    model: Model
    local: LocalTraining
    loss: Loss
    client_map: Callable
    neighbours: int
    epsilon: float
    beta: float
    loss_scale: str
    accumulate: str
    estep_data: str
    initial_loss: str
    shared_init: bool
    mixture_size: int
    m_step: str
    model_bytes: int
    grad_bytes: int


class Estimate(NamedTuple):
    """The participants' E-step rows [K, C]: loss estimates, seen flags, posteriors."""

    losses: jax.Array
    seen: jax.Array
    posterior: jax.Array


class Pairs(NamedTuple):
    """The round's (client, model) pairs, P = K * (n + 1) of them.

    Attributes:
      client: [P] client id of each pair (participant r's n + 1 pairs in a row).
      model: [P] model id of each pair.
      nbrs: [K, n + 1] the models each participant holds (itself first).
      scale: [K] loss scale of each participant (n_i, or 1 for "mean").
    """

    client: jax.Array
    model: jax.Array
    nbrs: jax.Array
    scale: jax.Array


def sample_neighbours(
    key: jax.Array, posterior: jax.Array, n: int, epsilon: float, clients: jax.Array | None = None
) -> jax.Array:
    """Epsilon-greedy neighbours of each client, itself first.

    Row r belongs to client c = clients[r]: with probability epsilon it takes n
    of the other C - 1 clients uniformly at random, otherwise the n others with
    the largest posterior[r] (ties broken at random). Client c's draw uses
    fold_in(key, c) only, so it does not depend on the other rows.

    Args:
      key: PRNG key of the round.
      posterior: [R, C] posterior rows.
      n: neighbours per client, 0 <= n <= C - 1.
      epsilon: exploration probability in [0, 1].
      clients: [R] client id of each row (default: 0..R-1).

    Returns:
      [R, n + 1] int32 distinct ids: column 0 is the client itself, then its n
      neighbours (by decreasing posterior when greedy).
    """
    rows, num = posterior.shape
    if not 0 <= n <= num - 1:
        raise ValueError(f"neighbours must be in [0, num_clients - 1 = {num - 1}], got {n}")
    clients = jnp.arange(rows) if clients is None else clients

    def one(c, w):
        explore_key, tie_key = jax.random.split(jax.random.fold_in(key, c))
        explore = jax.random.uniform(explore_key) < epsilon
        primary = jnp.where(explore, jnp.zeros_like(w), -w).at[c].set(jnp.inf)
        order = jnp.lexsort((jax.random.uniform(tie_key, (num,)), primary))
        return jnp.concatenate([c[None], order[:n]]).astype(jnp.int32)

    return jax.vmap(one)(clients, posterior)


def combine_gradients(
    pair_grads: Any, pair_weights: jax.Array, pair_models: jax.Array, num_models: int
) -> tuple[Any, jax.Array]:
    """M-step gradients: g_j = sum over pairs p with pair_models[p] == j of w_p grad_p.

    Args:
      pair_grads: pytree with [P, ...] leaves, one gradient per (client, model) pair.
      pair_weights: [P] weights (posterior times loss scale; 0 for inactive pairs).
      pair_models: [P] int model id of each pair.
      num_models: C.

    Returns:
      (grads with [C, ...] leaves, total weight [C] each model received).
    """

    def leaf(g):
        w = pair_weights.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
        return jax.ops.segment_sum(w * g, pair_models, num_segments=num_models)

    total = jax.ops.segment_sum(pair_weights, pair_models, num_segments=num_models)
    return jax.tree.map(leaf, pair_grads), total


def init(hp: FedericoHyper, key, params_template=None, num_clients: int = 1) -> FedericoState:
    """Every client's model (its own init, or the shared one), a uniform posterior."""
    if not 0 <= hp.neighbours <= num_clients - 1:
        raise ValueError(
            f"neighbours must be in [0, num_clients - 1 = {num_clients - 1}], got {hp.neighbours}"
        )
    if params_template is not None or hp.shared_init:
        params = hp.model.initial(key, params_template)
        stacked = broadcast(params, num_clients)
    else:
        stacked = jax.vmap(lambda c: hp.model.init(jax.random.fold_in(key, c)))(jnp.arange(num_clients))
    uniform = jnp.full((num_clients, num_clients), 1.0 / num_clients, jnp.float32)
    return FedericoState(
        stacked,
        jax.vmap(hp.local.optimizer.init)(stacked["params"]),
        jnp.zeros((num_clients, num_clients), jnp.float32),
        jnp.full((num_clients, num_clients), hp.initial_loss == "zero"),
        uniform,
        uniform,
        jnp.zeros([], jnp.int32),
    )


def round_pairs(hp: FedericoHyper, state: FedericoState, data: ClientData, part: Participants) -> Pairs:
    """The participants' neighbours (drawn from fold_in(sample_key, 1)) as pairs."""
    key = jax.random.fold_in(part.sample_key, 1)
    nbrs = sample_neighbours(key, state.client_posterior[part.ids], hp.neighbours, hp.epsilon, part.ids)
    counts = data.train.count[part.ids].astype(jnp.float32)
    scale = counts if hp.loss_scale == "sum" else jnp.ones_like(counts)
    return Pairs(jnp.repeat(part.ids, nbrs.shape[1]), nbrs.reshape(-1), nbrs, scale)


def objective(hp: FedericoHyper, params, rest, xb, yb, wb):
    """Weighted mean minibatch loss of one model, and its collection updates."""
    out, updates = hp.model.apply({**rest, "params": params}, xb, train=True)
    return masked_mean(hp.loss.per_example(out, yb), wb), updates


def round_batches(hp: FedericoHyper, train: ClientArrays, part: Participants, steps: int):
    """The participants' minibatches of all M-steps, step axis first: rows [S, K, B],
    weights [S, K, B], activity [S, K] (step s of client i's local schedule with key
    part.client_key(i), one epoch order per epoch: `batch_schedule`)."""

    def one(i):
        return batch_schedule(hp.local, part.client_key(i), train.count[i], train.n_max, steps)

    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), hp.client_map(one, part.ids))


def pair_function(hp: FedericoHyper, variables, train: ClientArrays, with_grad: bool = True) -> Callable:
    """pair (client i, model j, rows [B], weights [B]) -> the minibatch loss of model j on
    client i's rows and, with_grad, its gradient and collection updates (train mode)."""
    grad_fn = jax.value_and_grad(functools.partial(objective, hp), has_aux=True)

    def one(pair):
        i, j, r, w = pair
        v = take(variables, j)
        rest = {c: v[c] for c in v if c != "params"}
        xb, yb = train.rows(i, r)
        if not with_grad:
            return objective(hp, v["params"], rest, xb, yb, w)[0]
        (loss, updates), grads = grad_fn(v["params"], rest, xb, yb, w)
        return loss, grads, updates

    return one


def pair_args(pairs: Pairs, batch) -> tuple:
    """The pair function's inputs [P, ...] of the step whose participants' minibatches
    are `batch` = (rows [K, B], weights [K, B], activity [K])."""
    held = pairs.nbrs.shape[1]
    rows, wts, _ = batch
    return pairs.client, pairs.model, jnp.repeat(rows, held, axis=0), jnp.repeat(wts, held, axis=0)


def pair_activity(pairs: Pairs, batch) -> jax.Array:
    """[K, n+1]: each pair is active when its client's step is."""
    return jnp.repeat(batch[2], pairs.nbrs.shape[1]).reshape(pairs.nbrs.shape)


def sequential(client_map: Callable) -> bool:
    """True for a lax.map over single clients (the CPU default)."""
    return isinstance(client_map, ClientMap) and client_map.resolved() == "map" and not client_map.chunk_size


def variables_count(variables) -> int:
    """C, the models' leading axis."""
    return jax.tree.leaves(variables["params"])[0].shape[0]


def pair_step(hp: FedericoHyper, variables, train: ClientArrays, pairs: Pairs, batch, coef: jax.Array):
    """One M-step's pairs: loss [K, n+1], the gradients g_j = sum of coef [K, n+1] times
    the pair gradients of model j ([C, ...], `combine_gradients`), the total weight [C]
    and the pair updates [P, ...]. Under a sequential map each pair's weighted gradient
    is added to its model's row as it comes (a scan: no [P, ...] gradients); otherwise
    one mapped call gives the [P, ...] gradients, then their segment sum."""
    one, args, num = pair_function(hp, variables, train), pair_args(pairs, batch), variables_count(variables)
    weights = coef.reshape(-1)
    if not sequential(hp.client_map):
        loss, grads, updates = hp.client_map(one, args)
        summed, total = combine_gradients(grads, weights, pairs.model, num)
        return loss.reshape(coef.shape), summed, total, updates

    def add(acc, xs):
        pair, w = xs
        loss, grads, updates = one(pair)
        acc = jax.tree.map(lambda a, g: a.at[pair[1]].add(w.astype(g.dtype) * g), acc, grads)
        return acc, (loss, updates)

    zeros = jax.tree.map(jnp.zeros_like, variables["params"])
    summed, (loss, updates) = jax.lax.scan(add, zeros, (args, weights))
    total = jax.ops.segment_sum(weights, pairs.model, num_segments=num)
    return loss.reshape(coef.shape), summed, total, updates


def full_losses(hp: FedericoHyper, variables, train: ClientArrays, pairs: Pairs) -> jax.Array:
    """[K, n+1] mean loss of every pair's model on all its client's rows (eval mode)."""

    def one(pair):
        i, j = pair
        v = take(variables, j)
        sums = lambda x, y, valid: score_sums(hp.model.apply(v, x, train=False)[0], y, valid, hp.loss)  # noqa: E731
        rows = lambda r: train.rows(i, r)  # noqa: E731
        return means(client_sums(sums, rows, train.count[i], n_max=max_rows(train)), train.count[i])["loss"]

    return hp.client_map(one, (pairs.client, pairs.model)).reshape(pairs.nbrs.shape)


def running_losses(
    losses: jax.Array,
    seen: jax.Array,
    observed: jax.Array,
    mask: jax.Array,
    beta: float,
    accumulate: str = "ema",
) -> tuple[jax.Array, jax.Array]:
    """FedeRiCo's estimate of each model's loss on a client's data, after one observation.

    Where `mask` holds, a model seen before moves to (1 - beta) old + beta observed
    ("ema", the paper's) or old + observed ("cumulative"); one not seen before takes the
    observation. Arrays broadcast together (e.g. [clients, models]). Returns
    (losses, seen); the client's posterior over the models is then
    `pfljax.core.mixture.posterior(losses, mask=seen)`."""
    if accumulate not in ACCUMULATE:
        raise ValueError(f"running_losses: accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    jnp.broadcast_shapes(*(jnp.shape(a) for a in (losses, seen, observed, mask)))  # ValueError if not
    new = (1.0 - beta) * losses + beta * observed if accumulate == "ema" else losses + observed
    new = jnp.where(seen, new, observed)
    return jnp.where(mask, new, losses), seen | mask


def e_step(hp: FedericoHyper, estimate: Estimate, pair_loss, observed_mask, pairs: Pairs) -> Estimate:
    """The estimate after observing pair_loss [K, n+1] where observed_mask holds."""
    rows, nbrs = jnp.arange(pairs.nbrs.shape[0])[:, None], pairs.nbrs
    observed = pair_loss * pairs.scale[:, None]
    old, was_seen = estimate.losses[rows, nbrs], estimate.seen[rows, nbrs]
    new, now_seen = running_losses(old, was_seen, observed, observed_mask, hp.beta, hp.accumulate)
    losses = estimate.losses.at[rows, nbrs].set(new)
    seen = estimate.seen.at[rows, nbrs].set(now_seen)
    return Estimate(losses, seen, mixture.posterior(losses, mask=seen))


def initial_estimate(
    hp: FedericoHyper, state: FedericoState, train: ClientArrays, part: Participants, pairs: Pairs, batch
) -> Estimate:
    """The participants' Estimate rows after the round's E-step: on all training rows
    (estep_data="full", eval mode), or on the first M-step's minibatches `batch` (train
    mode: the losses of the models before any M-step, where the step's pairs are active)."""
    ids = part.ids
    estimate = Estimate(state.client_losses[ids], state.client_seen[ids], state.client_posterior[ids])
    if hp.estep_data == "full":
        has_data = jnp.broadcast_to((train.count[ids] > 0)[:, None], pairs.nbrs.shape)
        return e_step(hp, estimate, full_losses(hp, state.client_params, train, pairs), has_data, pairs)
    one = pair_function(hp, state.client_params, train, with_grad=False)
    loss = hp.client_map(one, pair_args(pairs, batch)).reshape(pairs.nbrs.shape)
    return e_step(hp, estimate, loss, pair_activity(pairs, batch), pairs)


def apply_gradients(hp: FedericoHyper, variables, opt_state, grads, total: jax.Array):
    """One optimizer step of every model that received positive total weight [C]
    (vmapped whatever the client map: one pass over the stacked models)."""
    if hp.m_step == "mean":
        inv = 1.0 / jnp.maximum(total, 1e-30)
        grads = jax.tree.map(lambda g: g * inv.reshape((-1,) + (1,) * (g.ndim - 1)), grads)

    def one(args):
        g, opt, params, go = args
        upd, new_opt = hp.local.optimizer.update(g, opt, params)
        new = (optax.apply_updates(params, upd), new_opt)
        return jax.tree.map(lambda a, b: jnp.where(go, a, b), new, (params, opt))

    new_params, new_opt = jax.vmap(one)((grads, opt_state, variables["params"], total > 0))
    return {**variables, "params": new_params}, new_opt


def owner_statistics(variables, updates, active: jax.Array, part: Participants):
    """Non-"params" collections (BatchNorm statistics) of the participants' own
    models from their own forward passes (pair column 0), where active."""
    rest_keys = [c for c in variables if c != "params"]
    if not rest_keys:
        return variables
    shape = active.shape
    own = {c: jax.tree.map(lambda u: u.reshape(shape + u.shape[1:])[:, 0], updates[c]) for c in rest_keys}
    cur = {c: variables[c] for c in rest_keys}
    go = active[:, 0]
    kept = jax.tree.map(
        lambda u, o: jnp.where(go.reshape((-1,) + (1,) * (u.ndim - 1)), u, o), own, part.gather(cur)
    )
    return {**variables, **part.scatter(cur, kept)}


def weighted_pair_loss(held_posterior, loss, active) -> jax.Array:
    """The M-step objective: each participant's posterior-weighted loss of its
    models, mean over the participants with data."""
    w = held_posterior * active
    client_loss = jnp.sum(w * loss, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1e-30)
    has = jnp.any(active, axis=1)
    return jnp.sum(client_loss * has) / jnp.maximum(jnp.sum(has), 1)


def m_step(hp: FedericoHyper, train: ClientArrays, part: Participants, pairs: Pairs, estimate, carry, batch):
    """Scan body: one M-step on the current models with the round's posterior rows
    (`estimate`, after the E-step); carry (variables, opt_state), batch its minibatches."""
    variables, opt_state = carry
    active = pair_activity(pairs, batch)
    held = estimate.posterior[jnp.arange(pairs.nbrs.shape[0])[:, None], pairs.nbrs]  # w_ij [K, n+1]
    coef = held * pairs.scale[:, None] * active
    loss, summed, total, updates = pair_step(hp, variables, train, pairs, batch, coef)
    variables, opt_state = apply_gradients(hp, variables, opt_state, summed, total)
    variables = owner_statistics(variables, updates, active, part)
    return (variables, opt_state), weighted_pair_loss(held, loss, active)


def store_estimate(state: FedericoState, estimate: Estimate, part: Participants) -> FedericoState:
    """The participants' estimate rows written back; the running mean posterior updated."""
    old = (state.client_losses, state.client_seen, state.client_posterior)
    losses, seen, posterior = (part.scatter(x, e) for x, e in zip(old, estimate))
    r = (state.round + 1).astype(jnp.float32)
    mean = state.client_posterior_mean + (posterior - state.client_posterior_mean) / r
    return state._replace(
        client_losses=losses, client_seen=seen, client_posterior=posterior, client_posterior_mean=mean
    )


def round_metrics(hp: FedericoHyper, posterior, step_losses, k: int, steps: int) -> dict:
    """train_loss (mean over the M-steps), the exchange's bytes and posterior summaries."""
    entropy = -jnp.sum(posterior * jnp.log(jnp.maximum(posterior, 1e-30)), axis=-1)
    return {
        "train_loss": jnp.mean(step_losses),
        "bytes_up": jnp.float32(k * hp.neighbours * steps * hp.grad_bytes),
        "bytes_down": jnp.float32(k * hp.neighbours * steps * hp.model_bytes),
        "self_weight": jnp.mean(jnp.diagonal(posterior)),
        "posterior_entropy": jnp.mean(entropy),
        "posterior": posterior,
    }


def step(hp: FedericoHyper, state: FedericoState, data: ClientData, part: Participants):
    """The round's step for `federated_round`: neighbours, E-step, S M-steps."""
    pairs = round_pairs(hp, state, data, part)
    steps = num_scan_steps(hp.local, data.train.n_max)
    batches = round_batches(hp, data.train, part, steps)
    estimate = initial_estimate(hp, state, data.train, part, pairs, jax.tree.map(lambda x: x[0], batches))
    body = functools.partial(m_step, hp, data.train, part, pairs, estimate)
    carry = (state.client_params, state.client_opt_state)
    (variables, opt_state), step_losses = jax.lax.scan(body, carry, batches)
    new_state = store_estimate(state, estimate, part)
    new_state = new_state._replace(client_params=variables, client_opt_state=opt_state)
    return new_state, None, round_metrics(hp, new_state.client_posterior, step_losses, part.k, steps)


def mixture_weights(hp: FedericoHyper, posterior: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each client's `mixture_size` largest weights (renormalised) and their models [C, m]."""
    num = posterior.shape[0]
    m = num if hp.mixture_size == 0 else min(int(hp.mixture_size), num)
    top_w, top_j = jax.lax.top_k(posterior, m)
    return top_w / jnp.sum(top_w, axis=-1, keepdims=True), top_j


def evaluate(hp: FedericoHyper, state: FedericoState, data: ClientData, key) -> dict:
    """Each client's mixture prediction, and its own model (own_accuracy, own_loss), on its
    real test rows: per chunk, its m mixture models and its own one after another.
    Deterministic: `key` is unused."""
    del key
    test = data.test
    top_w, top_j = mixture_weights(hp, state.client_posterior)

    def one(c):
        models = gather(state.client_params, jnp.append(top_j[c], c))  # [m + 1, ...]

        def sums(x, y, valid):
            outs = jax.lax.map(lambda v: hp.model.apply(v, x, train=False)[0], models)
            mixed = score_sums(mixture.predict(outs[:-1], top_w[c], hp.loss.name), y, valid, hp.loss)
            own = score_sums(outs[-1], y, valid, hp.loss)
            return {**mixed, "own_accuracy": own["accuracy"], "own_loss": own["loss"]}

        rows = lambda r: test.rows(c, r)  # noqa: E731
        return means(client_sums(sums, rows, test.count[c], n_max=max_rows(test)), test.count[c])

    return hp.client_map(one, jnp.arange(test.count.shape[0]))


def collaboration_matrix(state: FedericoState) -> jax.Array:
    """[C, C] posterior averaged over the rounds so far (rows sum to 1)."""
    return state.client_posterior_mean


def group_mass(posterior: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[C] posterior mass each client puts on the models of its own group."""
    posterior, groups = np.asarray(posterior), np.asarray(groups)
    same = groups[:, None] == groups[None, :]
    return np.sum(np.where(same, posterior, 0.0), axis=1)


def group_purity(posterior: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[C] share of a client's model overlap that is with its own group.

    Models are exchangeable under the M-step (a model is trained by whoever
    weights it, not only by its owner), so `group_mass` can be low while
    groups are perfectly separated. With overlap S = W W^T (S[i, k]: chance
    that clients i and k draw the same model from their posteriors), purity_i
    = sum over k in i's group of S[i, k] / sum over all k of S[i, k].
    """
    posterior, groups = np.asarray(posterior, np.float64), np.asarray(groups)
    overlap = posterior @ posterior.T
    same = groups[:, None] == groups[None, :]
    return np.sum(np.where(same, overlap, 0.0), axis=1) / np.maximum(np.sum(overlap, axis=1), 1e-30)


def final_report(state: FedericoState, fed_data, per_client: dict | None = None, key=None) -> dict:
    """JSON numbers: mean self weight, effective collaborators (exp entropy of w_i),
    and with client groups in fed_data.summary: own-group mass and group purity.
    `per_client` and `key` (the Algorithm field's signature) are unused."""
    del per_client, key
    post = np.asarray(jax.device_get(state.client_posterior), np.float64)
    entropy = -np.sum(post * np.log(np.maximum(post, 1e-30)), axis=1)
    report = {
        "self_weight": float(np.mean(np.diag(post))),
        "effective_collaborators": float(np.mean(np.exp(entropy))),
    }
    clients = (getattr(fed_data, "summary", None) or {}).get("clients", [])
    groups = [c.get("group") for c in clients]
    if groups and all(g is not None for g in groups):
        mass = group_mass(post, np.asarray(groups))
        report["own_group_mass"] = float(np.mean(mass))
        report["own_group_mass_min"] = float(np.min(mass))
        report["group_purity"] = float(np.mean(group_purity(post, np.asarray(groups))))
        report["own_group_mass_chance"] = float(
            np.mean(np.sum(np.equal.outer(groups, groups), 1) / len(groups))
        )
    return report


def make_hyper(
    model: Model, local: LocalTraining, client_map, neighbours, epsilon, beta, loss_scale, accumulate,
    estep_data, initial_loss, shared_init, mixture_size, m_step,
) -> FedericoHyper:  # fmt: skip
    """`build`'s options, their choices checked (ValueError naming the bad one), as a FedericoHyper."""
    for name, value, allowed in (
        ("loss_scale", loss_scale, LOSS_SCALES),
        ("accumulate", accumulate, ACCUMULATE),
        ("estep_data", estep_data, ESTEP_DATA),
        ("initial_loss", initial_loss, INITIAL_LOSSES),
        ("m_step", m_step, M_STEPS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    local = local.validate()
    template = model.template()
    return FedericoHyper(
        model, local, get_loss(local.loss), as_client_map(client_map), int(neighbours), epsilon, beta,
        loss_scale, accumulate, estep_data, initial_loss, shared_init, mixture_size, m_step,
        P.tree_bytes(template), P.tree_bytes(template["params"]),
    )  # fmt: skip


# Why the clients cannot live in host memory (pfljax.runtime.offload).
HOST_STORAGE_REFUSED = (
    "each client keeps O(C) state ([C, C] likelihoods and posteriors) and trains "
    "on its neighbours' models, rows of clients that do not take part"
)

DOMAINS = {
    "neighbours": Domain(0, integer=True, note="at most num_clients - 1"),
    "epsilon": Domain(0, 1),
    "beta": Domain(0, 1),
    "mixture_size": Domain(0, integer=True, note="0: all models"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    neighbours: int = 3,
    epsilon: float = 0.3,
    beta: float = 0.6,
    loss_scale: str = "sum",
    accumulate: str = "ema",
    estep_data: str = "batch",
    initial_loss: str = "first",
    shared_init: bool = False,
    mixture_size: int = 0,
    m_step: str = "sum",
) -> Algorithm:
    """FedeRiCo (see the module docstring).

    Args:
      model: every client's model.
      local: optimizer of the M-step (the paper: Adam, lr 1e-3), batch size,
        and steps per round (local.steps, or local.epochs epochs), loss.
      clients_per_round: K clients doing E- and M-steps each round (None: all).
      client_map: client-axis mapping strategy (see pfljax.core.clients).
      neighbours: n models each client fetches besides its own.
      epsilon: probability of sampling the n neighbours uniformly at random.
      beta: EMA rate of the loss estimates (accumulate="ema").
      loss_scale: "sum" (negative log-likelihood of the client's data, n_i times
        the mean; the paper) or "mean" (mean per-sample loss).
      accumulate: "ema" (paper default) or "cumulative" (running sum of losses).
      estep_data: "batch" (the first minibatch of the round) or "full" (all
        training rows, in eval mode).
      initial_loss: "first" (a model's estimate starts at its first observed
        loss; models client i has not evaluated yet get weight 0) or "zero"
        (L_hat starts at 0: unevaluated models look perfect).
      shared_init: start every client from the same model (init's key or
        params_template) instead of its own initialisation (fold_in(key, c)).
        Identical models are a fixed point: with neighbours = C - 1 they get
        identical losses, a uniform posterior and identical gradients forever.
      mixture_size: models in each client's prediction mixture, the largest
        weights (0: all C).
      m_step: "sum" (the paper: g_j = sum_i w_ij grad L_i, with L_i the summed
        NLL under loss_scale="sum", so a model's step grows with n_i and with
        how many clients pick it; fine with Adam) or "mean" (g_j divided by
        sum_i w_ij (times n_i), the scale plain SGD needs; not in the paper).
    """
    hp = make_hyper(
        model, local, client_map, neighbours, epsilon, beta, loss_scale, accumulate, estep_data,
        initial_loss, shared_init, mixture_size, m_step,
    )  # fmt: skip
    return Algorithm(
        functools.partial(init, hp),
        federated_round(functools.partial(step, hp), clients_per_round=clients_per_round),
        functools.partial(evaluate, hp),
        collaboration_matrix=collaboration_matrix,
        final_report=final_report,
    )
