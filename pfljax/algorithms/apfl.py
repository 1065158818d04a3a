"""APFL (Y. Deng et al., "Adaptive Personalized Federated Learning", 2020).

Each client keeps a local model v and a mixing weight alpha in [0, 1]; its
prediction is that of the mixture alpha v + (1 - alpha) w with the global model w.
Each local step (the schedule of `local`) draws one minibatch and, from the values
before the step (the paper's Algorithm 1):
- w_i (the client's copy of w, from the global model) steps on f(w_i);
- v steps on the gradient of f(alpha v + (1 - alpha) w_i) w.r.t. v (alpha times
  the mixture's gradient), both with `local.optimizer` (fresh states each round);
- with `alpha_lr` > 0, alpha takes an SGD step of that size on the mixture's
  gradient w.r.t. alpha, <v - w_i, grad f(mixture)>, and is clipped to [0, 1]
  (alpha_lr = 0: alpha stays fixed at `alpha`).
The server averages the w_i uniformly (`weighting="samples"` weights by train
size); v and alpha never leave the client. Evaluation: the mixture of each
client's v and alpha with the current global model. BatchNorm statistics of the
mixture are v's (updated by its forward pass); w's are w's.

Paper vs code: the mixture is of parameters (`mix="params"`); the authors' code
(FedTorch) mixes the two models' outputs, alpha f(v; x) + (1 - alpha) f(w; x)
(`mix="outputs"`), updates alpha only at the first step of a round, by its own
gradient formula plus a 0.01 alpha^2 penalty, and defaults to alpha = 0.5 (the
default here). Only sampled clients train, as in the code.
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
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked, known_zero
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.local import LocalTraining, epoch_orders, own_steps, run_steps, step_batch
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

MIXES = ("params", "outputs")


class APFLState(NamedTuple):
    global_params: Any  # w (full variables)
    client_params: Any  # v, full variables [C, ...]
    client_alpha: jax.Array  # [C] mixing weights in [0, 1]
    round: jax.Array


class APFLHyper(NamedTuple):
    """Model apply, local training, the alpha step size (0: fixed) and the kind of mixture."""

    apply: Callable
    local: LocalTraining
    alpha_lr: float
    mix: str


def mixed_apply(apply: Callable, mix: str, variables: dict, x, train: bool = False):
    """Output of the mixture of variables {"v", "w", "alpha"} on x, and v's collection updates."""
    v, w, alpha = variables["v"], variables["w"], variables["alpha"]
    if mix == "outputs":
        out_v, updates = apply(v, x, train=train)
        return alpha * out_v + (1 - alpha) * apply(w, x, train=train)[0], updates
    params = jax.tree.map(lambda a, b: alpha * a + (1 - alpha) * b, v["params"], w["params"])
    return apply({**v, "params": params}, x, train=train)


def model_loss(hp: APFLHyper, params, variables, xb, yb, wb):
    """Mean loss of `variables` with `params` on a weighted batch, and its collection updates."""
    out, updates = hp.apply({**variables, "params": params}, xb, train=True)
    return masked_mean(get_loss(hp.local.loss).per_example(out, yb), wb), updates


def mixture_loss(hp: APFLHyper, params, alpha, v, w, xb, yb, wb):
    """Mean loss of the mixture of v (with `params`) and w (held fixed) at `alpha`, and v's updates."""
    mixed = {"v": {**v, "params": params}, "w": jax.lax.stop_gradient(w), "alpha": alpha}
    out, updates = mixed_apply(hp.apply, hp.mix, mixed, xb, train=True)
    return masked_mean(get_loss(hp.local.loss).per_example(out, yb), wb), updates


def local_step(hp: APFLHyper, data: ClientArrays, key, orders, carry, s):
    """One local step of w, v (and alpha) on minibatch s, all from the values before the step."""
    (w, v, alpha, w_opt, v_opt), w_loss_sum = carry
    rows, wb, active = step_batch(hp.local, key, s, data.count, data.x.shape[0], orders)
    xb, yb = data.x[rows], data.y[rows]
    w_grad = jax.value_and_grad(functools.partial(model_loss, hp), has_aux=True)
    (w_loss, w_upd), gw = w_grad(w["params"], w, xb, yb, wb)
    mix_grad = jax.value_and_grad(functools.partial(mixture_loss, hp), argnums=(0, 1), has_aux=True)
    (v_loss, v_upd), (gv, ga) = mix_grad(v["params"], alpha, v, w, xb, yb, wb)
    opt = hp.local.optimizer
    w_step, w_opt_new = opt.update(gw, w_opt, w["params"])
    v_step, v_opt_new = opt.update(gv, v_opt, v["params"])
    new = (
        {**w, **w_upd, "params": optax.apply_updates(w["params"], w_step)},
        {**v, **v_upd, "params": optax.apply_updates(v["params"], v_step)},
        alpha if known_zero(hp.alpha_lr) else jnp.clip(alpha - hp.alpha_lr * ga, 0.0, 1.0),
        w_opt_new,
        v_opt_new,
    )
    kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry[0])
    return (kept, w_loss_sum + w_loss * active), v_loss, active


def client_update(hp: APFLHyper, state: APFLState, cid, own, data, key):
    """ONE client: the local steps from (global w, own v, own alpha).

    Returns ((w_i, v, alpha, mean loss of w_i), mean loss of the mixture).
    """
    v, alpha = own
    w = state.global_params
    opt = hp.local.optimizer
    carry = (w, v, alpha, opt.init(w["params"]), opt.init(v["params"]))
    orders = epoch_orders(hp.local, key, data.count, data.x.shape[0])
    body = functools.partial(local_step, hp, data, key, orders)
    ((w, v, alpha, _, _), w_loss_sum), v_loss = run_steps(
        hp.local, data.count, data.x.shape[0], body, (carry, jnp.float32(0.0))
    )
    n = jnp.maximum(own_steps(hp.local, data.count), 1)
    return (w, v, alpha, w_loss_sum / n), v_loss


def own_models(state: APFLState, part: Participants):
    """What a participant brings: its v and alpha."""
    return part.gather((state.client_params, state.client_alpha))


def server_update(state: APFLState, outputs, part: Participants):
    """The weighted mean of the w_i is the new global model; v and alpha stored; mean alpha and w loss."""
    w_new, v_new, alpha_new, w_loss = outputs
    weights = aggregate.normalized_weights(part.weights)
    state = state._replace(
        global_params=part.mean(w_new),
        client_params=part.scatter(state.client_params, v_new),
        client_alpha=part.scatter(state.client_alpha, alpha_new),
    )
    return state, {"global_loss": jnp.sum(weights * w_loss), "alpha": jnp.sum(weights * alpha_new)}


def init(model: Model, alpha: float, key, params_template=None, num_clients: int = 1) -> APFLState:
    """w and every v start from the same model; every alpha at `alpha`."""
    params = model.initial(key, params_template)
    alphas = jnp.full((num_clients,), alpha, jnp.float32)
    return APFLState(params, broadcast(params, num_clients), alphas, jnp.zeros([], jnp.int32))


def evaluate(hp: APFLHyper, client_map, state: APFLState, data: ClientData, key):
    """Each client's mixture of its v (at its alpha) with the global model, on its test rows."""

    def mixture(c):
        return {"v": take(state.client_params, c), "w": state.global_params, "alpha": state.client_alpha[c]}

    apply = functools.partial(mixed_apply, hp.apply, hp.mix)
    return evaluate_clients(apply, mixture, data.test, client_map, hp.local.loss)


DOMAINS = {
    "alpha": Domain(0, 1),
    "alpha_lr": Domain(0, note="0: alpha fixed"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    alpha: float = 0.5,
    alpha_lr: float = 0.0,
    mix: str = "params",
    weighting: str = "uniform",
) -> Algorithm:
    """APFL: local models mixed with the global model by a per-client weight alpha.

    Args:
      alpha: the initial (or, with alpha_lr = 0, fixed) mixing weight, in [0, 1].
      alpha_lr: SGD step size of alpha (0: alpha fixed; the paper uses the local
        learning rate).
      mix: "params" (the paper: mixture of parameters) or "outputs" (the authors'
        code: mixture of the two models' outputs).
      weighting: "uniform" (paper and code) or "samples".
      Others: as fedavg.build; `local` sets the optimizer, batch size and steps.
    """
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    check_weighting(weighting)
    cmap = as_client_map(client_map)
    hp = APFLHyper(model.apply, local.validate(), alpha_lr, mix)
    model_bytes = P.tree_bytes(model.template())
    step = client_step(functools.partial(client_update, hp), server_update, cmap, own_models)
    return Algorithm(
        functools.partial(init, model, alpha),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            bytes_up=model_bytes,
            bytes_down=model_bytes,
        ),
        functools.partial(evaluate, hp, cmap),
    )
