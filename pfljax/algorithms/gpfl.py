"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao & Guan, "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning", ICCV 2023).

The model is split into a body phi (every layer but the last) and a head h (its last Dense, on
the features z = phi(x) [d]). Two server-side modules are shared with the body: the Global
Category Embedding layer (GCE, a table g [classes, d]) and the Conditional Valve (CoV): two
branches Linear -> ReLU -> LayerNorm ([d] -> [d]) that map a conditional input c [d] to
gamma(c) and beta(c), and CoV(z, c) = ReLU(z * (gamma(c) + 1) + beta(c)). Each client builds two
conditional inputs from the GCE's embeddings: the global one, their plain mean, and its
personalized one, their mean weighted by its own class shares n_{i,y} / n_i (of its train rows;
both constants, no gradient). On each minibatch it takes one optimizer step, for phi, h, the
GCE and the CoV together, on
- the cross-entropy of h(f_P), f_P = CoV(z, personalized input) (the personalized task route);
- the angle-level guidance: the cross-entropy of the cosines cos(f_G, g_c) (scale 1) between
  f_G = CoV(z, global input) and every class embedding (the global guidance route);
- lam times the magnitude-level guidance ||f_G - g'_y||_2, g' the GCE the client received this
  round held fixed (mean over the batch's examples);
- mu / 2 (||GCE||^2 + ||CoV||^2) (PFLlib: SGD weight decay mu on the GCE and the CoV).
The server averages the body, the GCE and the CoV over the participants (weighted by train
size, or uniformly); the head h stays on its client. A client predicts h(CoV(phi(x), its
personalized input)), with the global body, GCE and CoV.

Evaluation: PFLlib evaluates at the start of each round, before local training; here
`evaluate` runs after a round, with what each client would hold at the start of the next one
(the new body, CoV and conditional inputs, its own head): the same models, one call earlier.

Options (the paper's names): `lam` (lambda, magnitude-level guidance, default 0.01) and `mu`
(the regularization of the GCE and CoV, default 0.1): the values the authors' GPFL repository
gives for the 4-layer CNN (PFLlib's FMNIST model) and 3-layer MLP (its run_me.sh). PFLlib's
main.py defaults, lam 1.0 and mu 0.0 (its generic -lam / -mu flags), are options.
`guidance_norm` and `conditional_inputs`: see "Paper vs code".

Paper vs code (PFLlib's clientgpfl / servergpfl; the authors' GPFL repository has the same client):
- `guidance_norm="mean"` (default, the paper's E_(x,y) ||f_G - g_y||_2): the per-example
  L2 norms averaged over the batch; "batch" is the code's torch.norm of the whole [B, d]
  difference, sqrt(sum over the batch of ||f_G - g_y||^2), not divided by B.
- `conditional_inputs="global"` (default, the paper's): built from the global GCE the
  client receives, every round; "local" is the code's: a client's inputs are refreshed
  when the server broadcasts the GCE, from its own GCE before the overwrite: its locally
  trained GCE if it took part in the previous round, else the global GCE of that round's
  start; zero vectors in round 0.
- The code counts a client's classes over its shuffled drop_last train loader (a random
  subset when B does not divide its size); here over all its train rows.
- The code's learning-rate decay acts on the body and head only; pfljax's optimizer is
  one optax transformation for all four (no decay by default, as PFLlib's FMNIST runs).
Heads start as copies of the initial model's head (PFLlib's deepcopy). The CoV's Linear
layers start as torch's default (uniform in +-1/sqrt(d)), LayerNorm at scale 1, bias 0
(eps 1e-5); the GCE as torch's nn.Embedding (standard normal).

Not implemented: the CoV and GCE of other shapes; PFLlib's slow-client simulation.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked, known_zero
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.heads import apply_with_head, dense, feature_dim, linear_head, take_head
from pfljax.core.local import LocalTraining, epoch_orders, run_steps, step_batch
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

GUIDANCE_NORMS = ("mean", "batch")
CONDITIONAL_INPUTS = ("global", "local")
NORMALIZE_EPS = 1e-12  # torch's F.normalize
LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm


class GPFLState(NamedTuple):
    global_params: Any  # the body: the model's variables without the head's params
    gce: jax.Array  # [classes, d] global category embeddings
    cov: Any  # the conditional valve's params {"gamma", "beta"}
    client_heads: Any  # personal heads {"kernel", "bias"} [C, ...]
    client_conditions: Any  # "local" inputs: [C, 2, d] (global, personalized) from the own GCE; else None
    client_last: Any  # "local" inputs: [C] int32 the last round the client took part in (-1); else None
    previous_gce: Any  # "local" inputs: the GCE at the start of the previous round; else None
    round: jax.Array


class GPFLHyper(NamedTuple):
    """The model and its head's name, local training, and the method's options."""

    model: Model
    head: str
    local: LocalTraining
    lam: float
    mu: float
    guidance_norm: str
    conditional_inputs: str
    num_classes: int


def init_cov(key: jax.Array, d: int) -> dict:
    """CoV params: per branch, a Linear [d, d] at torch's default init and a LayerNorm (1, 0)."""

    def branch(k):
        kk, kb = jax.random.split(k)
        bound = 1.0 / jnp.sqrt(d)
        return {
            "kernel": jax.random.uniform(kk, (d, d), jnp.float32, -bound, bound),
            "bias": jax.random.uniform(kb, (d,), jnp.float32, -bound, bound),
            "scale": jnp.ones((d,), jnp.float32),
            "offset": jnp.zeros((d,), jnp.float32),
        }

    kg, kb = jax.random.split(key)
    return {"gamma": branch(kg), "beta": branch(kb)}


def layer_norm(h: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
    """torch's LayerNorm over the last axis (biased variance, eps 1e-5)."""
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean((h - mean) ** 2, -1, keepdims=True)
    return (h - mean) / jnp.sqrt(var + LAYER_NORM_EPS) * scale + offset


def cov_branch(p: dict, c: jax.Array) -> jax.Array:
    """LayerNorm(ReLU(c @ kernel + bias)) of a conditional input c [d]."""
    return layer_norm(jax.nn.relu(c @ p["kernel"] + p["bias"]), p["scale"], p["offset"])


def cov_apply(cov: dict, z: jax.Array, c: jax.Array) -> jax.Array:
    """CoV(z, c) = ReLU(z * (gamma(c) + 1) + beta(c)) for features z [B, d]."""
    return jax.nn.relu(z * (cov_branch(cov["gamma"], c) + 1.0)[None] + cov_branch(cov["beta"], c)[None])


def safe_sqrt(sq: jax.Array) -> jax.Array:
    """sqrt(sq) with gradient 0 at sq = 0 (torch's norm), not NaN."""
    pos = sq > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, sq, 1.0)), 0.0)


def normalize(v: jax.Array) -> jax.Array:
    """v / max(||v||, 1e-12) over the last axis (torch's F.normalize)."""
    return v / jnp.maximum(safe_sqrt(jnp.sum(v * v, -1, keepdims=True)), NORMALIZE_EPS)


def cosine_logits(f: jax.Array, gce: jax.Array) -> jax.Array:
    """cos(f_b, g_c) [B, classes]: the angle-level guidance's logits."""
    return normalize(f) @ normalize(gce).T


def class_shares(y: jax.Array, count: jax.Array, num_classes: int) -> jax.Array:
    """n_c / n over the `count` real rows of one client [classes] (zeros when empty)."""
    valid = (jnp.arange(y.shape[0]) < count).astype(jnp.float32)
    counts = jnp.sum(jax.nn.one_hot(y, num_classes) * valid[:, None], axis=0)
    return counts / jnp.maximum(jnp.sum(counts), 1.0)


def conditions(gce: jax.Array, shares: jax.Array) -> jax.Array:
    """[2, d]: the global conditional input (the embeddings' mean) and the personalized one
    (their mean weighted by the client's class shares); constants (no gradient)."""
    gce = jax.lax.stop_gradient(gce)
    return jnp.stack([jnp.mean(gce, 0), shares @ gce])


def start_conditions(hp: GPFLHyper, state: GPFLState, stored, last, shares: jax.Array) -> jax.Array:
    """A client's conditional inputs [2, d] at the start of round `state.round`: from the
    global GCE ("global"), or PFLlib's ("local"): zeros in round 0; from its own trained GCE
    (`stored`) if it took part in the previous round; else from that round's starting GCE."""
    if hp.conditional_inputs == "global":
        return conditions(state.gce, shares)
    # Round 0: client_last starts at -1 and the stored inputs at zero.
    return jnp.where(last == state.round - 1, stored, conditions(state.previous_gce, shares))


def forward(hp: GPFLHyper, base: dict, head: dict, cov: dict, cond: jax.Array, x, train: bool):
    """((logits h(f_P) [B, classes], f_G [B, d]), updates) of the model's body on x."""

    def head_fn(z):
        return dense(head, cov_apply(cov, z, cond[1])), cov_apply(cov, z, cond[0])

    return apply_with_head(hp.model, hp.head, base, x, train, head_fn)


def objective(hp: GPFLHyper, params: dict, rest: dict, fixed, xb, yb, wb):
    """GPFL's loss of one minibatch (rows weighted by wb): (total, (loss without the mu term,
    updates)). `params`: {"base", "head", "gce", "cov"}; `fixed`: (conditional inputs [2, d],
    the received GCE [classes, d])."""
    cond, frozen = fixed
    base = {**rest, "params": params["base"]}
    (logits, f_g), updates = forward(hp, base, params["head"], params["cov"], cond, xb, True)
    ce = optax.softmax_cross_entropy_with_integer_labels
    per = ce(logits, yb) + ce(cosine_logits(f_g, params["gce"]), yb)
    diff = f_g - frozen[yb]
    if hp.guidance_norm == "mean":
        loss = masked_mean(per + hp.lam * safe_sqrt(jnp.sum(diff * diff, -1)), wb)
    else:  # the code's: the norm of the batch's [B, d] difference (real rows only)
        loss = masked_mean(per, wb) + hp.lam * safe_sqrt(jnp.sum(wb[:, None] * diff * diff))
    total = loss
    if not known_zero(hp.mu):
        sq = sum(jnp.sum(v * v) for v in jax.tree.leaves((params["gce"], params["cov"])))
        total = total + 0.5 * hp.mu * sq
    return total, (loss, updates)


def local_train(hp: GPFLHyper, params: dict, rest: dict, fixed, data, key):
    """The local schedule (core.local's batches) on `objective`; returns (params, rest, mean loss)."""
    spec, n_max = hp.local, data.x.shape[0]
    opt = spec.optimizer
    grad_fn = jax.grad(functools.partial(objective, hp), has_aux=True)
    orders = epoch_orders(spec, key, data.count, n_max)

    def step(carry, s):
        params, rest, opt_state = carry
        rows, wb, active = step_batch(spec, key, s, data.count, n_max, orders)
        grads, (loss, updates) = grad_fn(params, rest, fixed, data.x[rows], data.y[rows], wb)
        upd, new_opt = opt.update(grads, opt_state, params)
        new = (optax.apply_updates(params, upd), {**rest, **updates}, new_opt)
        return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry), loss, active

    (params, rest, _), loss = run_steps(spec, data.count, n_max, step, (params, rest, opt.init(params)))
    return params, rest, loss


def client_update(hp: GPFLHyper, state: GPFLState, cid, own, data, key):
    """ONE client: its conditional inputs, then the local steps from the global body, GCE and CoV
    and its own head. Returns ((body, GCE, CoV), head, inputs from its trained GCE), loss."""
    head, stored, last = own
    shares = class_shares(data.y, data.count, hp.num_classes)
    cond = start_conditions(hp, state, stored, last, shares)
    body = state.global_params
    start = {"base": body["params"], "head": head, "gce": state.gce, "cov": state.cov}
    rest = {k: v for k, v in body.items() if k != "params"}
    params, rest, loss = local_train(hp, start, rest, (cond, state.gce), data, key)
    upload = ({**rest, "params": params["base"]}, params["gce"], params["cov"])
    return (upload, params["head"], conditions(params["gce"], shares)), loss


def own_rows(state: GPFLState, part: Participants):
    """What a participant brings: its head (and, for "local" inputs, its stored inputs)."""
    return part.gather((state.client_heads, state.client_conditions, state.client_last))


def server_update(hp: GPFLHyper, state: GPFLState, outputs, part: Participants):
    """Body, GCE and CoV: the weighted mean of the uploads; heads (and "local" inputs) stored."""
    upload, heads, own_conditions = outputs
    (body, gce, cov), metrics = part.average(upload, (state.global_params, state.gce, state.cov))
    new = state._replace(
        global_params=body, gce=gce, cov=cov, client_heads=part.scatter(state.client_heads, heads)
    )
    if hp.conditional_inputs == "local":
        new = new._replace(
            client_conditions=part.scatter(state.client_conditions, own_conditions),
            client_last=part.scatter(state.client_last, jnp.full((part.k,), state.round, jnp.int32)),
            previous_gce=state.gce,
        )
    return new, metrics


def init(hp: GPFLHyper, key, params_template=None, num_clients: int = 1) -> GPFLState:
    """The model's body; every head a copy of its head; GCE ~ N(0, 1); CoV at torch's init."""
    variables = hp.model.initial(key, params_template)
    body, head = take_head(variables, hp.head)
    d = feature_dim(hp.model, hp.head)
    gce = jax.random.normal(jax.random.fold_in(key, 1), (hp.num_classes, d), jnp.float32)
    cov = init_cov(jax.random.fold_in(key, 2), d)
    local = hp.conditional_inputs == "local"
    return GPFLState(
        body,
        gce,
        cov,
        broadcast(head, num_clients),
        jnp.zeros((num_clients, 2, d), jnp.float32) if local else None,
        jnp.full((num_clients,), -1, jnp.int32) if local else None,
        gce if local else None,
        jnp.zeros([], jnp.int32),
    )


def evaluate(hp: GPFLHyper, client_map, state: GPFLState, data: ClientData, key):
    """Each client's h(CoV(phi(x), personalized input)) on its test rows, with the inputs it
    would use in the next round."""

    def model_of(c):
        train = take(data.train, c)
        shares = class_shares(train.y, train.count, hp.num_classes)
        stored, last = take((state.client_conditions, state.client_last), c)
        cond = start_conditions(hp, state, stored, last, shares)
        return {
            "base": state.global_params,
            "head": take(state.client_heads, c),
            "cov": state.cov,
            "cond": cond,
        }

    def apply(v, x, train=False):
        (logits, _), _ = forward(hp, v["base"], v["head"], v["cov"], v["cond"], x, False)
        return logits, {}

    return evaluate_clients(apply, model_of, data.test, client_map)


DOMAINS = {
    "lam": Domain(0, note="0: no magnitude-level guidance"),
    "mu": Domain(0, note="0: no regularization of the GCE and CoV"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    lam: float = 0.01,
    mu: float = 0.1,
    guidance_norm: str = "mean",
    conditional_inputs: str = "global",
    weighting: str = "samples",
    privacy: ClientDP | None = None,
) -> Algorithm:
    """GPFL on a model whose last layer is one Dense.

    Args:
      lam: weight of the magnitude-level guidance ||f_G - g_y|| (>= 0).
      mu: weight decay of the GCE and CoV, mu / 2 ||.||^2 (>= 0).
      guidance_norm: "mean" (the paper's per-example norms, averaged) or "batch" (PFLlib's
        norm of the whole batch's difference).
      conditional_inputs: "global" (the paper's, from the received GCE) or "local" (PFLlib's).
      Others: as fedavg.build; `local` sets the optimizer and schedule of all four parts.
        Classification only (`local.loss` "cross_entropy").
    """
    check_weighting(weighting)
    local = local.validate()
    if get_loss(local.loss).name != "cross_entropy":
        raise ValueError(f"GPFL needs local.loss 'cross_entropy', got {get_loss(local.loss).name!r}")
    if guidance_norm not in GUIDANCE_NORMS:
        raise ValueError(f"guidance_norm must be one of {GUIDANCE_NORMS}, got {guidance_norm!r}")
    if conditional_inputs not in CONDITIONAL_INPUTS:
        raise ValueError(
            f"conditional_inputs must be one of {CONDITIONAL_INPUTS}, got {conditional_inputs!r}"
        )
    head = linear_head(model, "GPFL")
    hp = GPFLHyper(model, head, local, lam, mu, guidance_norm, conditional_inputs, model.num_outputs)
    cmap = as_client_map(client_map)
    step = client_step(
        functools.partial(client_update, hp), functools.partial(server_update, hp), cmap, own_rows
    )
    d = feature_dim(model, head)
    shared = jax.eval_shape(lambda: (take_head(model.template(), head)[0], init_cov(jax.random.key(0), d)))
    shared_bytes = P.tree_bytes(shared) + model.num_outputs * d * 4
    return Algorithm(
        functools.partial(init, hp),
        federated_round(
            step,
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=shared_bytes,
            bytes_down=shared_bytes,
        ),
        functools.partial(evaluate, hp, cmap),
    )
