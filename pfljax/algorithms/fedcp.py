"""FedCP (Zhang, Hua, Wang, Song, Xue, Ma & Guan, "FedCP: Separating Feature Information for
Personalized Federated Learning via Conditional Policy", KDD 2023).

The model is split into a feature extractor (every layer but the last) and a head (its last
Dense, on the features h = base(x) [d]). Each client keeps a personalized head W_i; the server
holds the feature extractor, a global head W and the Conditional Policy Network (CPN): Linear
(d -> 2d), LayerNorm, ReLU, reshaped to [2, d] and put through a Gumbel-Softmax over the 2 (at
temperature `tau`), which gives per sample and per feature the personalized policy s and the
global one r = 1 - s. Its input is h * v_i, v_i the client's context: the sum over classes of
its personalized head's weight rows, L2-normalized. A client's output is
W_i(s * h) + W(r * h); the global head W is frozen during local training. On each minibatch
the client takes one optimizer step, for the extractor, its personalized head and the CPN, on
  cross-entropy + lam * MMD(h, h0),
h0 = base0(x) the features of a frozen copy of the extractor it received (MMD: the biased
estimate with the sum of the Gaussian kernels exp(-||a - b||^2 / (2 sigma)), sigma in 10, 15,
20, 50, PFLlib's; rows weighted by the batch's weights). The participants upload the
extractor, the CPN and their personalized heads (`head_upload_weight`); the server averages
each (train size weights, or uniform) into the next extractor, CPN and global head W, and a
participant's context becomes that of its trained personalized head.

Evaluation: PFLlib evaluates at the start of each round, before local training; here
`evaluate` runs after a round, with what each client holds at the start of the next one (the
new extractor, global head and CPN, its own personalized head and context): the same models,
one call earlier.

Options: `lam` (lambda, the MMD weight; default 1.0, PFLlib main.py's `-lam`; the authors'
FedCP repository runs MNIST with `-lam 5`; the paper's own value could not be read here),
`tau` (the Gumbel-Softmax temperature, 1.0: the code's), `head_upload_weight`,
`initial_context`, `inference_noise` and `send_global` (below).

Paper vs code (PFLlib's clientcp / servercp; the authors' FedCP repository has the same code):
- `head_upload_weight=1.0` (default, the paper's: its overview figure, in the authors' slides,
  marks W_i "upload & train", averaged into the global head): a participant uploads
  w W_i + (1 - w) W; PFLlib's generate_upload_head is w = 0.5.
- `initial_context="head"` (default, the paper's v_i, from the personalized head, which starts
  as a copy of the model's head): PFLlib starts every client with torch.rand(1, d) (uniform in
  [0, 1)) until its first participation: "random".
- `inference_noise=True` (default): the policy at evaluation also adds Gumbel noise, as PFLlib
  does (torch's gumbel_softmax samples in eval mode too; no other inference rule of the
  paper could be read here, only its slides); False: the noiseless soft policy
  softmax(logits / tau). The noise is drawn per client (its id) and test row from the
  evaluation key. Training noise: per step from the client's round key (its own stream,
  apart from the batch order).
- `send_global="all"` (default): every client starts its next local training from, and is
  evaluated with, the latest global head and CPN (what the server holds). PFLlib sends them to
  the round's participants only (the extractor to all): a client that sat out keeps the ones it
  last received, trains from them when it next takes part (its upload mixing its stale W) and is
  evaluated with them: "participants" (each client's copy kept in the state, [C, ...]; refused
  with client-level DP, whose clipped updates need one common reference). The two are the same
  under full participation (PFLlib's FMNIST protocol).
- The optimizer is `local.optimizer`, fresh each round, over the extractor, personalized head
  and CPN (PFLlib's one persistent SGD over them: the same for plain SGD). BatchNorm
  statistics travel with the extractor (PFLlib averages parameters only); the frozen copy runs
  in training mode, as PFLlib's, its updates discarded.
The pair's first half is s (PFLlib's pm), its second r. The CPN starts as torch's default
(Linear uniform in +-1/sqrt(d), LayerNorm scale 1, bias 0, eps 1e-5), the global and
personalized heads as copies of the model's head.

Not implemented: the hard (straight-through) Gumbel-Softmax; the paper's ablation without the
CPN (`lam=0` is the one without MMD alignment; it skips the frozen extractor's forward pass);
PFLlib's slow-client simulation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, broadcast, take
from pfljax.core.domains import Domain, checked, known_zero
from pfljax.core.evaluate import EVAL_CHUNK, client_sums, max_rows, means, score_sums
from pfljax.core.heads import apply_with_head, dense, feature_dim, features, linear_head, put_head, take_head
from pfljax.core.local import LocalTraining, epoch_orders, own_steps, run_steps, step_batch
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, client_step, federated_round
from pfljax.core.types import Algorithm, ClientData
from pfljax.models.base import Model

BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # PFLlib's rbf MMD: sum of exp(-0.5 * ||a - b||^2 / sigma)
NORMALIZE_EPS = 1e-12  # torch's F.normalize
LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm
INITIAL_CONTEXTS = ("head", "random")
SEND_GLOBAL = ("all", "participants")


class FedCPState(NamedTuple):
    global_params: Any  # extractor + global head W (the model's variables; its head is W)
    cpn: Any  # the CPN's params {"kernel" [d, 2d], "bias", "scale", "offset" [2d]}
    client_heads: Any  # personalized heads W_i ({"kernel", "bias"} [C, ...])
    client_context: jax.Array  # [C, d] contexts before normalization
    round: jax.Array
    # send_global="participants": each client's last received (global head W, CPN) [C, ...]; else None
    client_received: Any = None


class FedCPHyper(NamedTuple):
    """The model and its head's name, local training, and the method's options."""

    model: Model
    head: str
    local: LocalTraining
    lam: float
    tau: float
    head_upload_weight: float
    initial_context: str
    inference_noise: bool
    send_global: str


def init_cpn(key: jax.Array, d: int) -> dict:
    """The CPN's params at torch's default init: Linear(d, 2d) uniform in +-1/sqrt(d), LayerNorm (1, 0)."""
    kk, kb = jax.random.split(key)
    bound = 1.0 / jnp.sqrt(d)
    return {
        "kernel": jax.random.uniform(kk, (d, 2 * d), jnp.float32, -bound, bound),
        "bias": jax.random.uniform(kb, (2 * d,), jnp.float32, -bound, bound),
        "scale": jnp.ones((2 * d,), jnp.float32),
        "offset": jnp.zeros((2 * d,), jnp.float32),
    }


def context_of(head: dict) -> jax.Array:
    """A personalized head's context [d]: the sum over classes of its weight rows (kernel [d, k])."""
    return jnp.sum(head["kernel"], axis=1)


def normalize(v: jax.Array) -> jax.Array:
    """v / max(||v||, 1e-12) over the last axis (torch's F.normalize)."""
    return v / jnp.maximum(jnp.sqrt(jnp.sum(v * v, -1, keepdims=True)), NORMALIZE_EPS)


def lead(v: jax.Array, like: jax.Array) -> jax.Array:
    """A vector v [n] with leading axes of size 1 to broadcast against `like` [..., m]."""
    return v.reshape((1,) * (like.ndim - 1) + v.shape)


def policy(cpn: dict, u: jax.Array, tau: float, noise: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(s, r): the personalized and global policies [..., d] of CPN inputs u [..., d] (s + r = 1):
    softmax over the pair of (ReLU(LayerNorm(u @ kernel + bias)) viewed as [..., 2, d] + noise) / tau."""
    a = u @ cpn["kernel"] + lead(cpn["bias"], u)
    mean = jnp.mean(a, -1, keepdims=True)
    var = jnp.mean((a - mean) ** 2, -1, keepdims=True)
    a = jax.nn.relu(
        (a - mean) / jnp.sqrt(var + LAYER_NORM_EPS) * lead(cpn["scale"], u) + lead(cpn["offset"], u)
    )
    a = a.reshape(a.shape[:-1] + (2, u.shape[-1]))
    if noise is not None:
        a = a + noise
    p = jax.nn.softmax(a / tau, axis=-2)
    return p[..., 0, :], p[..., 1, :]


def forward(hp: FedCPHyper, base: dict, parts: dict, x: jax.Array, train: bool, noise: Callable | None):
    """((logits W_i(s * h) + W(r * h), features h), updates) of the extractor `base` on x.
    `parts`: {"head" W_i, "global_head" W, "cpn", "context" [d]}; `noise(shape)`: Gumbel noise of
    the policy's logits [..., 2, d] (None: the noiseless policy)."""

    def head_fn(h):
        u = h * lead(normalize(parts["context"]), h)
        g = None if noise is None else noise(h.shape[:-1] + (2, h.shape[-1]))
        s, r = policy(parts["cpn"], u, hp.tau, g)
        return dense(parts["head"], h * s) + dense(parts["global_head"], h * r), h

    return apply_with_head(hp.model, hp.head, base, x, train, head_fn)


def mmd(a: jax.Array, b: jax.Array, w: jax.Array) -> jax.Array:
    """Biased MMD^2 between rows of a and b [B, d] with row weights w [B] (PFLlib's rbf MMD,
    its mean over the B x B kernel matrices when every weight is 1)."""
    aa, bb, ab = a @ a.T, b @ b.T, a @ b.T
    ra, rb = jnp.diag(aa), jnp.diag(bb)
    dists = (
        ra[:, None] + ra[None] - 2 * aa,
        rb[:, None] + rb[None] - 2 * bb,
        ra[:, None] + rb[None] - 2 * ab,
    )
    kxx, kyy, kxy = (sum(jnp.exp(-0.5 * dd / s) for s in BANDWIDTHS) for dd in dists)
    ww = w[:, None] * w[None]
    return jnp.sum(ww * (kxx + kyy - 2.0 * kxy)) / jnp.maximum(jnp.sum(w), 1.0) ** 2


def objective(hp: FedCPHyper, params: dict, rest: dict, fixed: dict, xb, yb, wb, noise: Callable):
    """FedCP's loss of one minibatch (rows weighted by wb): (CE + lam * MMD, (CE, MMD, updates)).
    `params`: {"base", "head", "cpn"}; `fixed`: {"global_head", "context", "frozen" (the
    received extractor's variables)}."""
    base = {**rest, "params": params["base"]}
    parts = {"head": params["head"], "cpn": params["cpn"], **fixed}
    (logits, h), updates = forward(hp, base, parts, xb, True, noise)
    ce = masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, yb), wb)
    if known_zero(hp.lam):  # no alignment: the frozen extractor's forward pass is left out
        return ce, (ce, jnp.float32(0.0), updates)
    h0, _ = features(hp.model, hp.head, fixed["frozen"], xb, True)
    flat = lambda z: z.reshape(z.shape[0], -1)  # noqa: E731
    dist = mmd(flat(h), jax.lax.stop_gradient(flat(h0)), wb)
    return ce + hp.lam * dist, (ce, dist, updates)


def local_train(hp: FedCPHyper, params: dict, rest: dict, fixed: dict, data, key):
    """The local schedule (core.local's batches) on `objective`, Gumbel noise per step from
    `key`'s noise stream. Returns (params, rest, mean CE, mean MMD) over the active steps."""
    spec, n_max = hp.local, data.x.shape[0]
    opt = spec.optimizer
    grad_fn = jax.grad(functools.partial(objective, hp), has_aux=True)
    orders = epoch_orders(spec, key, data.count, n_max)
    noise_key = noise_stream(key)

    def step(carry, s):
        params, rest, opt_state, mmd_sum = carry
        rows, wb, active = step_batch(spec, key, s, data.count, n_max, orders)
        noise = functools.partial(jax.random.gumbel, jax.random.fold_in(noise_key, s))
        grads, (ce, dist, updates) = grad_fn(params, rest, fixed, data.x[rows], data.y[rows], wb, noise)
        upd, new_opt = opt.update(grads, opt_state, params)
        new = (optax.apply_updates(params, upd), {**rest, **updates}, new_opt, mmd_sum + dist)
        return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry), ce, active

    init = (params, rest, opt.init(params), jnp.float32(0.0))
    (params, rest, _, mmd_sum), ce = run_steps(spec, data.count, n_max, step, init)
    return params, rest, ce, mmd_sum / jnp.maximum(own_steps(spec, data.count), 1)


def noise_stream(key: jax.Array) -> jax.Array:
    """The key of a client's training noise (step s: fold_in(noise_stream(key), s)), apart from
    the batch order that `key` itself draws."""
    return jax.random.split(key)[1]


def client_update(hp: FedCPHyper, state: FedCPState, cid, own, data, key):
    """ONE client: the local steps from the global extractor, the CPN and its own head, with the
    global head and the received extractor frozen (head and CPN: the server's, or with
    `client_received` the client's last received ones). Returns ((extractor + uploaded head,
    CPN), personalized head, its context, mean MMD), mean CE."""
    head, context, received = own
    body, global_head = take_head(state.global_params, hp.head)
    global_head, cpn = (global_head, state.cpn) if received is None else received
    rest = {k: v for k, v in body.items() if k != "params"}
    start = {"base": body["params"], "head": head, "cpn": cpn}
    fixed = {"global_head": global_head, "context": context, "frozen": body}
    params, rest, ce, dist = local_train(hp, start, rest, fixed, data, key)
    w = hp.head_upload_weight
    upload = jax.tree.map(lambda p, g: w * p + (1.0 - w) * g, params["head"], global_head)
    trained = put_head({**rest, "params": params["base"]}, hp.head, upload)
    return ((trained, params["cpn"]), params["head"], context_of(params["head"]), dist), ce


def server_update(hp: FedCPHyper, state: FedCPState, outputs, part: Participants):
    """Extractor, global head and CPN: the weighted mean of the uploads; personalized heads and
    their contexts stored; with `client_received` the new head and CPN sent to the
    participants only; the participants' mean MMD."""
    upload, heads, contexts, dist = outputs
    (global_params, cpn), metrics = part.average(upload, (state.global_params, state.cpn))
    received = state.client_received
    if received is not None:
        sent = (take_head(global_params, hp.head)[1], cpn)
        received = part.scatter(received, broadcast(sent, part.k))
    new = state._replace(
        global_params=global_params,
        cpn=cpn,
        client_heads=part.scatter(state.client_heads, heads),
        client_context=part.scatter(state.client_context, contexts),
        client_received=received,
    )
    return new, {"mmd": part.mean(dist), **metrics}


def init(hp: FedCPHyper, key, params_template=None, num_clients: int = 1) -> FedCPState:
    """The model (its head the global head), every personalized head a copy of its head, the CPN
    at torch's init, contexts from the heads ("head") or uniform in [0, 1) ("random"); with
    send_global="participants" every client holding the initial head and CPN."""
    variables = hp.model.initial(key, params_template)
    head = variables["params"][hp.head]
    d = feature_dim(hp.model, hp.head)
    if hp.initial_context == "head":
        context = broadcast(context_of(head), num_clients)
    else:
        context = jax.random.uniform(jax.random.fold_in(key, 2), (num_clients, d), jnp.float32)
    cpn = init_cpn(jax.random.fold_in(key, 1), d)
    received = broadcast((head, cpn), num_clients) if hp.send_global == "participants" else None
    heads = broadcast(head, num_clients)
    return FedCPState(variables, cpn, heads, context, jnp.zeros([], jnp.int32), received)


def evaluate(hp: FedCPHyper, client_map, state: FedCPState, data: ClientData, key):
    """Each client's W_i(s * h) + W(r * h) on its test rows, with the global extractor, head and
    CPN (or with `client_received` its own last received head and CPN) and its own head and
    context; Gumbel noise (`inference_noise`) of test row j of client c from
    fold_in(fold_in(key, c), j)."""
    body, global_head = take_head(state.global_params, hp.head)
    test, n_max = data.test, max_rows(data.test)
    d = feature_dim(hp.model, hp.head)

    def one(c):
        head, context, received = take((state.client_heads, state.client_context, state.client_received), c)
        shared_head, cpn = (global_head, state.cpn) if received is None else received
        parts = {"head": head, "global_head": shared_head, "cpn": cpn, "context": context}
        client_key = jax.random.fold_in(key, data.client_id(c))

        def sums(x, yr, valid):
            y, r = yr
            noise = None
            if hp.inference_noise:
                rows = jax.vmap(lambda j: jax.random.gumbel(jax.random.fold_in(client_key, j), (2, d)))(r)
                noise = lambda shape: rows.reshape(shape)  # noqa: E731
            (logits, _), _ = forward(hp, body, parts, x, False, noise)
            return score_sums(logits, y, valid)

        def rows_of(r):
            x, y = test.rows(c, r)
            return x, (y, r)

        count = test.count[c]
        return means(client_sums(sums, rows_of, count, EVAL_CHUNK, n_max), count)

    return client_map(one, jnp.arange(test.count.shape[0]))


DOMAINS = {
    "lam": Domain(0, note="0: no MMD alignment"),
    "tau": Domain(0, low_open=True),
    "head_upload_weight": Domain(0, 1, note="1: the personalized head (paper), 0.5: PFLlib's"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    lam: float = 1.0,
    tau: float = 1.0,
    head_upload_weight: float = 1.0,
    initial_context: str = "head",
    inference_noise: bool = True,
    send_global: str = "all",
    weighting: str = "samples",
    privacy: ClientDP | None = None,
) -> Algorithm:
    """FedCP on a model whose last layer is one Dense.

    Args:
      lam: weight of the MMD between the features and the received extractor's (>= 0).
      tau: Gumbel-Softmax temperature of the policy (> 0).
      head_upload_weight: w of the uploaded head w W_i + (1 - w) W (1: the paper's, 0.5: PFLlib's).
      initial_context: "head" (the paper's, from the personalized head) or "random" (PFLlib's
        uniform vector until a client's first participation).
      inference_noise: Gumbel noise in the policy at evaluation (PFLlib's), else the soft policy.
      send_global: who receives the new global head and CPN: "all" (default) or "participants"
        (PFLlib's code: a client that sat out keeps the ones it last received).
      Others: as fedavg.build; `local` sets the optimizer and schedule of the extractor,
        personalized head and CPN. Classification only (`local.loss` "cross_entropy").
    """
    check_weighting(weighting)
    local = local.validate()
    if get_loss(local.loss).name != "cross_entropy":
        raise ValueError(f"FedCP needs local.loss 'cross_entropy', got {get_loss(local.loss).name!r}")
    if initial_context not in INITIAL_CONTEXTS:
        raise ValueError(f"initial_context must be one of {INITIAL_CONTEXTS}, got {initial_context!r}")
    if not isinstance(inference_noise, bool):
        raise ValueError(f"inference_noise must be True or False, got {inference_noise!r}")
    if send_global not in SEND_GLOBAL:
        raise ValueError(f"send_global must be one of {SEND_GLOBAL}, got {send_global!r}")
    if privacy is not None and send_global == "participants":
        raise ValueError(
            "send_global='participants' cannot be used with client-level DP: the clients start from "
            "different heads and CPNs, so their updates have no common reference; use send_global='all'"
        )
    head = linear_head(model, "FedCP")
    options = (lam, tau, head_upload_weight, initial_context, inference_noise, send_global)
    hp = FedCPHyper(model, head, local, *options)
    cmap = as_client_map(client_map)
    step = client_step(
        functools.partial(client_update, hp),
        functools.partial(server_update, hp),
        cmap,
        lambda state, part: part.gather((state.client_heads, state.client_context, state.client_received)),
    )
    d = feature_dim(model, head)
    shared_bytes = P.tree_bytes(model.template()) + P.tree_bytes(
        jax.eval_shape(lambda: init_cpn(jax.random.key(0), d))
    )
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
