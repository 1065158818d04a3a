"""FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated Learning", AAAI 2023).

Each client keeps its local model l. Before local training, a sampled client
starts from its Adaptive Local Aggregation (ALA) of the global model g: the
lower layers take g, the top `layer_idx` layers take l + (g - l) * W with
element-wise weights W in [0, 1] (ones at first, kept across rounds), learned on
a random `rand_percent` % sample of its train rows: per minibatch (in a fixed
order, batches of `local.batch_size`), W <- clip(W - eta * grad * (g - l), 0, 1),
grad the loss gradient at the aggregated top layers. The first time (the client's
"start phase") W is trained epoch after epoch until the std of the last
`num_pre_loss` epochs' losses (each epoch's last batch) is below `threshold`;
later, one epoch. A client whose model still equals g (round 0) skips ALA. It
then trains locally (`local`); the server averages the models (FedAvg, weighted
by train size); each client's trained model is its personalized model.

Paper vs code (TsingZ0/FedALA `utils/ALA.py`, `serverALA.py`; PFLlib has the same):
- `layer_idx` counts layers here (the paper's p); the code's `layer_idx` counts
  parameter tensors, so its default 2 (the last layer's weight and bias) is 1 here.
- `threshold` defaults to the paper's 0.01 (the code's default is 0.1);
  `max_start_epochs` bounds the start phase (the code has no bound).
- The sample is a random subset of the rows (paper); the code takes a contiguous
  slice at a random offset of its stored order; both use int(s% * n) rows (here >= 1).
- `all_clients=True` runs ALA on every client each round, as the code's
  `send_models` does, not only on the sampled ones (paper).
- `evaluate_ala=True` evaluates the ALA of the current global model into each local
  model (the code evaluates after `send_models`); default: the trained local models.
- Only the "params" collection is aggregated by ALA; other collections (BatchNorm
  statistics) stay the client's own, as the code's buffers do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pfljax.algorithms import refused_when
from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, client_key, take
from pfljax.core.domains import Domain, checked
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.layers import last_layers
from pfljax.core.local import LocalTraining, batch_rows, make_local_train, shuffled_rows
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, federated_round, map_clients
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model


class FedALAState(NamedTuple):
    global_params: Any  # g (full variables)
    client_params: Any  # local models l_i (full variables) [C, ...]
    client_ala_weights: dict  # W_i over the top layers' "params" leaves {path: [C, ...]}
    client_started: jax.Array  # [C] bool: the start phase is done
    round: jax.Array


class ALASpec(NamedTuple):
    """ALA's options: weight learning rate eta, sample percent, start-phase stop rule, batch size."""

    eta: float
    rand_percent: int
    threshold: float
    num_pre_loss: int
    max_start_epochs: int
    batch_size: int


class FedALAHyper(NamedTuple):
    """The local trainer, the gradient of the loss at the top layers, which leaves
    ALA weighs (a bool tree over the variables), ALA's options and the bytes of a model."""

    train: Callable
    top_grad: Callable
    is_top: Any
    ala: ALASpec
    all_clients: bool
    model_bytes: float


def make_top_grad(apply_fn, loss):
    """top_grad(top, base, xb, yb, wb) -> (grad w.r.t. the top leaves {path: leaf}, loss)
    of the weighted mean loss of `base` with its top leaves replaced by `top`."""
    loss_obj = get_loss(loss)

    def objective(top, base, xb, yb, wb):
        out, _ = apply_fn(P.merge(base, top), xb, train=True)
        return masked_mean(loss_obj.per_example(out, yb), wb)

    return jax.value_and_grad(objective)


def ala_blend(local, glob, weights: dict, is_top) -> Any:
    """The start model: "params" from g below the top layers, l + (g - l) * W in them
    (as g W + l (1 - W): exactly g at W = 1); other collections from l."""
    start = {**local, "params": glob["params"]}
    top_l, top_g = P.split(local, is_top)[1], P.split(glob, is_top)[1]
    return P.merge(start, {k: top_g[k] * weights[k] + top_l[k] * (1 - weights[k]) for k in top_l})


def ala_sample(key: jax.Array, count: jax.Array, n_max: int, rand_percent: int):
    """(order [n_max], m): a random subset of m = max(int(s% * count), 1) real rows first."""
    m = jnp.maximum((count * rand_percent) // 100, 1)
    return shuffled_rows(key, count, n_max), jnp.minimum(m, count)


def ala_epoch(hp: FedALAHyper, local, glob, weights: dict, order, m, data: ClientArrays):
    """One pass over the sample in its order: W updated per batch; returns (W, last batch's loss)."""
    b = hp.ala.batch_size
    top_l, top_g = P.split(local, hp.is_top)[1], P.split(glob, hp.is_top)[1]
    diff = {k: top_g[k] - top_l[k] for k in top_l}

    def batch(carry, j):
        w, last = carry
        rows, wb = batch_rows(order, j, m, b)
        base = ala_blend(local, glob, w, hp.is_top)
        loss, grad = hp.top_grad(P.split(base, hp.is_top)[1], base, data.x[rows], data.y[rows], wb)
        new = {k: jnp.clip(w[k] - hp.ala.eta * grad[k] * diff[k], 0.0, 1.0) for k in w}
        active = j * b < m
        return jax.tree.map(lambda a, o: jnp.where(active, a, o), (new, loss), (w, last)), None

    most = max(order.shape[0] * hp.ala.rand_percent // 100, 1)  # static bound on m
    (w, last), _ = jax.lax.scan(batch, (weights, jnp.float32(0.0)), jnp.arange(-(-most // b)))
    return w, last


def ala_weights(hp: FedALAHyper, local, glob, weights, started, data: ClientArrays, key):
    """W after this round's weight learning: none if l == g, one epoch once started,
    else epochs until the std of the last `num_pre_loss` losses < threshold."""
    leaves = zip(jax.tree.leaves(local["params"]), jax.tree.leaves(glob["params"]))
    skip = jnp.all(jnp.stack([jnp.all(a == b) for a, b in leaves]))
    order, m = ala_sample(key, data.count, data.x.shape[0], hp.ala.rand_percent)
    n_pre = hp.ala.num_pre_loss

    def more(carry):
        _, n, losses = carry
        converged = (n > n_pre) & (jnp.std(losses) < hp.ala.threshold)
        return ~skip & ((n == 0) | (~started & ~converged & (n < hp.ala.max_start_epochs)))

    def epoch(carry):
        w, n, losses = carry
        w, loss = ala_epoch(hp, local, glob, w, order, m, data)
        return w, n + 1, losses.at[n % n_pre].set(loss)

    w, _, _ = jax.lax.while_loop(more, epoch, (weights, jnp.int32(0), jnp.zeros((n_pre,), jnp.float32)))
    return w, started | ~skip


def ala_update(hp: FedALAHyper, state: FedALAState, cid, own, data, key):
    """ONE client's ALA: (start model, W, started)."""
    local, weights, started = own
    glob = state.global_params
    w, started = ala_weights(hp, local, glob, weights, started, data, jax.random.fold_in(key, 0))
    return ala_blend(local, glob, w, hp.is_top), w, started


def client_update(hp: FedALAHyper, state: FedALAState, cid, start, data, key):
    """ONE client: local training from its ALA start model."""
    res = hp.train(start, data, jax.random.fold_in(key, 1))
    return res.params, res.loss


def own_state(state: FedALAState, who: Participants):
    """What ALA reads of each of `who`: (local model, W, started)."""
    return who.gather((state.client_params, state.client_ala_weights, state.client_started))


def step(hp: FedALAHyper, client_map, state: FedALAState, data: ClientData, part: Participants):
    """ALA on the participants (or every client), local training, FedAvg of the models."""
    who = part._replace(ids=jnp.arange(part.num_clients)) if hp.all_clients else part
    starts, w, started = map_clients(
        functools.partial(ala_update, hp), client_map, state, data, who, own_state(state, who)
    )
    state = state._replace(
        client_params=who.scatter(state.client_params, starts),
        client_ala_weights=who.scatter(state.client_ala_weights, w),
        client_started=who.scatter(state.client_started, started),
    )
    trained, losses = map_clients(
        functools.partial(client_update, hp), client_map, state, data, part, part.gather(state.client_params)
    )
    average, metrics = part.average(trained, state.global_params)
    state = state._replace(global_params=average, client_params=part.scatter(state.client_params, trained))
    return state, losses, {"bytes_down": jnp.float32(who.k * hp.model_bytes), **metrics}


def init(model: Model, is_top, key, params_template=None, num_clients: int = 1) -> FedALAState:
    params = model.initial(key, params_template)
    ones = {k: jnp.ones_like(v) for k, v in P.split(params, is_top)[1].items()}
    return FedALAState(
        params,
        broadcast(params, num_clients),
        broadcast(ones, num_clients),
        jnp.zeros((num_clients,), bool),
        jnp.zeros([], jnp.int32),
    )


def evaluate(
    hp: FedALAHyper, model: Model, client_map, loss, evaluate_ala: bool, state, data: ClientData, key
):
    """Each client's local model (or, with evaluate_ala, its ALA of the current g) on its test rows."""

    def variables_of(c):
        own = take((state.client_params, state.client_ala_weights, state.client_started), c)
        if not evaluate_ala:
            return own[0]
        return ala_update(hp, state, c, own, take(data.train, c), client_key(key, c))[0]

    return evaluate_clients(model.apply, variables_of, data.test, client_map, loss)


HOST_STORAGE_REFUSED = refused_when(
    "all_clients",
    False,
    "all_clients=True runs ALA on every client each round; all_clients=False "
    "(the default) only on the participants",
)


DOMAINS = {
    "eta": Domain(0),
    "rand_percent": Domain(0, 100, low_open=True, integer=True),
    "layer_idx": Domain(0, integer=True, note="0: all layers"),
    "threshold": Domain(0),
    "num_pre_loss": Domain(1, integer=True),
    "max_start_epochs": Domain(1, integer=True),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    eta: float = 1.0,
    rand_percent: int = 80,
    layer_idx: int = 1,
    threshold: float = 0.01,
    num_pre_loss: int = 10,
    max_start_epochs: int = 100,
    all_clients: bool = False,
    evaluate_ala: bool = False,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
) -> Algorithm:
    """FedALA.

    Args:
      eta: learning rate of the ALA weights (paper and code: 1.0).
      rand_percent: percent s of a client's train rows ALA learns on (80).
      layer_idx: number of top layers ALA weighs (paper's p; the code's 2 tensors = 1
        layer); 0: all layers (as in the code).
      threshold, num_pre_loss: the start phase stops when the std of the last
        `num_pre_loss` epoch losses is below `threshold` (paper 0.01, 10).
      max_start_epochs: the most epochs of the start phase.
      all_clients: ALA on every client each round (code), not only the sampled ones.
      evaluate_ala: evaluate the ALA start models (code) instead of the trained ones.
      Others: as fedavg.build; `local` also sets ALA's batch size and loss.
    """
    check_weighting(weighting)
    local = local.validate()
    cmap = as_client_map(client_map)
    template = model.template()
    patterns = (".",) if layer_idx == 0 else last_layers(model, layer_idx, argument="layer_idx")
    top = P.match_paths(template, patterns)
    is_top = {k: jax.tree.map(lambda t, p=(k == "params"): t and p, v) for k, v in top.items()}
    spec = ALASpec(eta, rand_percent, threshold, num_pre_loss, max_start_epochs, local.batch_size)
    model_bytes = P.tree_bytes(template)
    hp = FedALAHyper(
        make_local_train(model.apply, local),
        make_top_grad(model.apply, local.loss),
        is_top,
        spec,
        all_clients,
        model_bytes,
    )
    return Algorithm(
        functools.partial(init, model, is_top),
        federated_round(
            functools.partial(step, hp, cmap),
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=model_bytes,
            bytes_down=model_bytes,
        ),
        functools.partial(evaluate, hp, model, cmap, local.loss, evaluate_ala),
    )
