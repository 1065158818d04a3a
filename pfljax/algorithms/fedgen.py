"""FedGen (Zhu, Hong & Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning",
ICML 2021).

The model is split into a body and its head (the last layer, one Dense; PFLlib's
BaseHeadSplit). The server keeps a small generator G_w(eps, y) -> z, a feature
vector of the head's input width: noise eps and the one-hot label y through
Linear -> BatchNorm (batch statistics) -> ReLU -> Linear. Each round

- the server learns p(y), the label distribution of the round's participants
  (their label counts, pooled), and sends the global model and G_w;
- each participant runs the local schedule on its minibatches with the loss
      CE(f(x), y) + alpha_t * CE(h(G_w(eps, y')), y'),   y' ~ p(y), eps ~ noise,
  B generated rows per step (B the local batch size): only the head h learns
  from the generated features (the generator is fixed on the client);
- the server averages the uploaded models (FedAvg weights, `part.average`, so
  client-level DP applies to the model) and then trains G_w for `generator_steps`
  Adam steps to make the participants' heads classify G_w(eps, y) as y:
      CE(sum_k alpha_k^y h_k(G_w(eps, y)), y),   y ~ p(y),
  alpha_k^y = n_k^y / sum_j n_j^y (the paper's per-label ensemble weights, from
  the counts the clients upload), plus `diversity` times the authors' diversity
  loss exp(-mean_ij ||eps_i - eps_j||^2_mean * |z_i - z_j|_mean).
The generator and its Adam state live in the algorithm state and train inside the
compiled round. Evaluation: the global model on each client's test rows.

Options (defaults: PFLlib's main.py, the FedGen block, unless said): `noise_dim`
512 and `hidden_dim` 512 (the generator's widths), `generator_lr` 0.005 (Adam,
betas (0.9, 0.999), PFLlib's), `generator_steps` 1000 (PFLlib's server_epochs;
0: the generator stays as initialized), `generator_batch` 0 (labels per generator
step; 0: the local batch size, as PFLlib), `batch_norm` True, `noise` "normal"
(the paper's N(0, I)) or "uniform" (both codes' torch.rand, U[0, 1)), `ensemble`
"label" (the paper's alpha_k^y on the logits), "samples" (PFLlib's: train-size
weights, the same for every label), "authors_code" (the authors' code: each head's
own CE, weighted by its mean alpha_k^y over the batch's labels) or "label_loss"
(each head's CE weighted per row by alpha_k^{y}: what that code's weighting reads
as), `diversity` 0 (the paper's objective and PFLlib; the
authors' code uses 1), `generative_alpha` 1 and `generative_beta` 0 with
`generative_decay` 1 (the authors' code: 10, 10 and 0.98): alpha_t = alpha *
decay^t, beta_t = beta * decay^t in round t, and beta_t weighs the authors' extra
term KL(softmax(h(G_w(eps, y))) || softmax(f(x))) on each real row (the target
detached).

Paper vs code: the paper's local regularizer samples y' from the global label
distribution, weight 1 (PFLlib: the same); the authors' code adds the KL term
and decays both weights (options above). The paper weights the ensemble per label
(alpha_k^y); PFLlib by train size (`ensemble="samples"`); the authors' code sums the
heads' own weighted CEs (`ensemble="authors_code"`). The paper's noise is
Gaussian; both codes draw U[0, 1) (`noise="uniform"`). PFLlib pools the label
counts of all clients once; here p(y) is pooled over the round's participants
(the authors' code's choice; the same under full participation, PFLlib's
protocol), so the round reads only participants' rows. The generator never runs
in eval mode in either code: BatchNorm always uses the batch's statistics (no
running averages kept). With it, fc1 has no bias and its inputs are centred over the batch: the
same function (BatchNorm removes both), without the inert directions that Adam moves on rounding
noise.

Not implemented: PFLlib's `localize_feature_extractor` (only heads shared); the
authors' code's "qualified labels" threshold and their 1e-4 floor on the decayed weights. Under
client-level DP the generator still reads the participants' raw heads: only the
model average is private.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pfljax.core import params as P
from pfljax.core.clients import ClientMap, as_client_map, take
from pfljax.core.domains import Domain, checked, known_zero
from pfljax.core.evaluate import evaluate_clients
from pfljax.core.heads import dense, feature_dim, linear_head
from pfljax.core.local import LocalTraining, epoch_orders, first_order, local_batch, run_steps
from pfljax.core.losses import get_loss, masked_mean
from pfljax.core.privacy import ClientDP
from pfljax.core.round import Participants, check_weighting, federated_round, map_clients
from pfljax.core.types import Algorithm, ClientArrays, ClientData
from pfljax.models.base import Model

NOISES = ("normal", "uniform")
ENSEMBLES = ("label", "samples", "label_loss", "authors_code")
GEN_INIT = 0x6E  # the generator's init key: fold_in(init key, GEN_INIT)
GEN_STREAM = 0x6F  # generated rows: fold_in(client key, GEN_STREAM), then fold_in(., step)
SERVER_STREAM = 0x70  # the server's generator steps: fold_in(sample_key, SERVER_STREAM)
BN_EPS = 1e-5


class FedGenState(NamedTuple):
    global_params: Any  # the global model (full variables)
    generator: Any  # G_w's parameters
    generator_opt: Any  # its Adam state
    round: jax.Array


class FedGenHyper(NamedTuple):
    """Static settings of the round."""

    model: Model
    head: str
    local: LocalTraining
    num_classes: int
    noise_dim: int
    batch_norm: bool
    noise: str
    ensemble: str
    generator_steps: int
    generator_batch: int
    diversity: float
    alpha: float
    beta: float
    decay: float
    optimizer: optax.GradientTransformation


def _linear_init(key, fan_in: int, fan_out: int) -> dict:
    """torch.nn.Linear's default init: kernel and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    k1, k2 = jax.random.split(key)
    return {
        "kernel": jax.random.uniform(k1, (fan_in, fan_out), jnp.float32, -bound, bound),
        "bias": jax.random.uniform(k2, (fan_out,), jnp.float32, -bound, bound),
    }


def init_generator(
    key, noise_dim: int, num_classes: int, hidden_dim: int, out_dim: int, batch_norm: bool = True
) -> dict:
    """G_w's parameters: fc1 [noise + classes, hidden], bn (scale, bias) [hidden], fc [hidden, d].
    With batch_norm, fc1 has no bias: BatchNorm subtracts it again (torch's is inert there, save
    that Adam moves it on rounding noise, which only costs BatchNorm precision)."""
    k1, k2 = jax.random.split(key)
    fc1 = _linear_init(k1, noise_dim + num_classes, hidden_dim)
    gen = {
        "fc1": {"kernel": fc1["kernel"]} if batch_norm else fc1,
        "fc": _linear_init(k2, hidden_dim, out_dim),
    }
    if batch_norm:
        ones, zeros = jnp.ones((hidden_dim,), jnp.float32), jnp.zeros((hidden_dim,), jnp.float32)
        gen["bn"] = {"scale": ones, "bias": zeros}
    return gen


def generate(gen: dict, eps: jax.Array, labels: jax.Array, num_classes: int, batch_norm: bool = True):
    """G_w(eps, y) [B, d] for noise eps [B, noise_dim] and labels [B]; BatchNorm with the
    batch's statistics (biased variance, torch's train mode)."""
    inputs = jnp.concatenate([eps, jax.nn.one_hot(labels, num_classes)], axis=1)
    if batch_norm:  # BatchNorm removes the batch mean of fc1's output: centre its inputs instead
        inputs = inputs - jnp.mean(inputs, axis=0, keepdims=True)
    h = inputs @ gen["fc1"]["kernel"]
    if "bias" in gen["fc1"]:
        h = h + gen["fc1"]["bias"][None]
    if batch_norm:
        mu = jnp.mean(h, axis=0, keepdims=True)
        var = jnp.mean((h - mu) ** 2, axis=0, keepdims=True)
        h = (h - mu) / jnp.sqrt(var + BN_EPS) * gen["bn"]["scale"][None] + gen["bn"]["bias"][None]
    return dense(gen["fc"], jax.nn.relu(h))


def draw_noise(key, kind: str, shape) -> jax.Array:
    """eps: N(0, I) ("normal") or U[0, 1) ("uniform")."""
    if kind == "normal":
        return jax.random.normal(key, shape, jnp.float32)
    return jax.random.uniform(key, shape, jnp.float32)


def sample_labels(key, prior: jax.Array, n: int) -> jax.Array:
    """n labels [n] drawn from the distribution `prior` [classes] (sums to 1)."""
    logits = jnp.where(prior > 0, jnp.log(jnp.maximum(prior, 1e-30)), -jnp.inf)
    return jax.random.categorical(key, logits, shape=(n,))


def label_counts(data: ClientArrays, num_classes: int) -> jax.Array:
    """n^y [classes] over one client's real rows."""
    valid = (jnp.arange(data.y.shape[0]) < data.count).astype(jnp.float32)
    return jnp.sum(jax.nn.one_hot(data.y, num_classes) * valid[:, None], axis=0)


def diversity_loss(eps: jax.Array, z: jax.Array) -> jax.Array:
    """The authors' diversity loss exp(-mean_ij d2(eps_i, eps_j) * d1(z_i, z_j)), d2 the mean
    squared difference over entries, d1 the mean absolute difference."""
    noise_dist = jnp.mean((eps[:, None] - eps[None]) ** 2, axis=-1)
    feat_dist = jnp.mean(jnp.abs(z[:, None] - z[None]), axis=-1)
    return jnp.exp(jnp.mean(-noise_dist * feat_dist))


def weights_at(value: float, decay: float, round_: jax.Array) -> jax.Array:
    """value * decay^round (the authors' per-round schedule; decay 1: constant)."""
    return value * jnp.asarray(decay, jnp.float32) ** round_.astype(jnp.float32)


def client_objective(hp: FedGenHyper, alpha, beta, params, rest, xb, yb, wb, gen_z, gen_y, kl_z):
    """CE on the real rows + alpha * CE of the head on generated rows (+ beta * the authors'
    KL term); aux: (total, updates)."""
    out, updates = hp.model.apply({**rest, "params": params}, xb, train=True)
    total = masked_mean(optax.softmax_cross_entropy_with_integer_labels(out, yb), wb)
    gen_logits = dense(params[hp.head], gen_z)
    total = total + alpha * jnp.mean(optax.softmax_cross_entropy_with_integer_labels(gen_logits, gen_y))
    if kl_z is not None:
        target = jax.nn.softmax(dense(jax.lax.stop_gradient(params[hp.head]), kl_z))
        log_target = jnp.log(jnp.maximum(target, 1e-30))
        kl = jnp.sum(target * (log_target - jax.nn.log_softmax(out)), axis=-1)
        total = total + beta * masked_mean(kl, wb)
    return total, (total, updates)


def client_update(hp: FedGenHyper, state: FedGenState, cid, prior, data: ClientArrays, key):
    """ONE client: the local schedule from the global model on its rows plus generated
    features (labels from `prior`); returns (trained variables, mean loss)."""
    local = hp.local
    optimizer = local.optimizer
    n_max = data.x.shape[0]
    variables = state.global_params
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}
    orders = epoch_orders(local, key, data.count, n_max)
    alpha = weights_at(hp.alpha, hp.decay, state.round)
    beta = weights_at(hp.beta, hp.decay, state.round)
    gen = jax.lax.stop_gradient(state.generator)
    grad_fn = jax.grad(functools.partial(client_objective, hp, alpha, beta), has_aux=True)
    b = local.batch_size
    gen_key = jax.random.fold_in(key, GEN_STREAM)

    def step(carry, s):
        params, rest, opt_state, order = carry
        order, rows, w, active = local_batch(local, key, s, data.count, n_max, orders, order)
        xb, yb = data.x[rows], data.y[rows]
        k_lab, k_eps, k_kl = jax.random.split(jax.random.fold_in(gen_key, s), 3)
        gen_y = sample_labels(k_lab, prior, b)
        gen_z = generate(
            gen, draw_noise(k_eps, hp.noise, (b, hp.noise_dim)), gen_y, hp.num_classes, hp.batch_norm
        )
        kl_z = None
        if not known_zero(hp.beta):
            eps = draw_noise(k_kl, hp.noise, (b, hp.noise_dim))
            kl_z = generate(gen, eps, yb, hp.num_classes, hp.batch_norm)
        grads, (loss, updates) = grad_fn(params, rest, xb, yb, w, gen_z, gen_y, kl_z)
        upd, new_opt = optimizer.update(grads, opt_state, params)
        new = (optax.apply_updates(params, upd), {**rest, **updates}, new_opt)
        kept = jax.tree.map(lambda a, c: jnp.where(active, a, c), new, (params, rest, opt_state))
        return (*kept, order), loss, active

    order0 = first_order(local, key, data.count, n_max, orders)
    init = (params, rest, optimizer.init(params), order0)
    (params, rest, _, _), mean_loss = run_steps(local, data.count, n_max, step, init)
    return {**rest, "params": params}, mean_loss


def ensemble_weights(ensemble: str, counts: jax.Array, weights: jax.Array) -> jax.Array:
    """[K, classes] weights of each participant per label, summing to 1 over K: alpha_k^y =
    n_k^y / sum_j n_j^y (every ensemble but "samples"), or the aggregation weights [K] ("samples")."""
    if ensemble != "samples":
        return counts / jnp.maximum(jnp.sum(counts, axis=0, keepdims=True), 1.0)
    w = weights / jnp.sum(weights)
    return jnp.broadcast_to(w[:, None], counts.shape)


def generator_loss(hp: FedGenHyper, gen, heads, alphas, eps, labels):
    """The teacher loss of G_w(eps, y) (+ diversity); aux: the teacher loss alone. "label",
    "samples": CE of the weighted ensemble of the heads' logits; "label_loss": sum_k mean_b
    alpha_k^{y_b} CE_k(b), each head's CE weighted per row; "authors_code": sum_k (mean_b
    alpha_k^{y_b}) (mean_b CE_k(b)), what the authors' code computes (its per-row CE [B]
    times the weights [B, 1] broadcasts to [B, B], so a row's weight and its CE are not paired)."""
    z = generate(gen, eps, labels, hp.num_classes, hp.batch_norm)
    logits = jnp.einsum("bd,kdc->kbc", z, heads["kernel"]) + heads["bias"][:, None, :]
    weights = alphas[:, labels]  # [K, B]
    if hp.ensemble in ("label", "samples"):
        ens = jnp.sum(weights[..., None] * logits, axis=0)  # [B, classes]
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(ens, labels))
    else:
        per_head = optax.softmax_cross_entropy_with_integer_labels(logits, labels[None])  # [K, B]
        if hp.ensemble == "label_loss":
            ce = jnp.sum(jnp.mean(weights * per_head, axis=1))
        else:
            ce = jnp.sum(jnp.mean(weights, axis=1) * jnp.mean(per_head, axis=1))
    total = ce
    if not known_zero(hp.diversity):
        total = total + hp.diversity * diversity_loss(eps, z)
    return total, ce


def train_generator(hp: FedGenHyper, gen, opt_state, heads, alphas, prior, key):
    """`generator_steps` Adam steps on `generator_loss`; returns (gen, opt_state, CE [steps])."""
    grad_fn = jax.grad(functools.partial(generator_loss, hp), has_aux=True)

    def step(carry, t):
        gen, opt_state = carry
        k_lab, k_eps = jax.random.split(jax.random.fold_in(key, t))
        labels = sample_labels(k_lab, prior, hp.generator_batch)
        eps = draw_noise(k_eps, hp.noise, (hp.generator_batch, hp.noise_dim))
        grads, ce = grad_fn(gen, heads, alphas, eps, labels)
        upd, opt_state = hp.optimizer.update(grads, opt_state, gen)
        return (optax.apply_updates(gen, upd), opt_state), ce

    (gen, opt_state), ces = jax.lax.scan(step, (gen, opt_state), jnp.arange(hp.generator_steps))
    return gen, opt_state, ces


def participant_counts(hp: FedGenHyper, data: ClientData, part: Participants) -> jax.Array:
    """[K, classes] the participants' label counts (what FedGen's clients upload)."""
    return jax.vmap(lambda c: label_counts(take(data.train, c), hp.num_classes))(part.ids)


def step(hp: FedGenHyper, client_map, state: FedGenState, data: ClientData, part: Participants):
    """Label counts, local training with generated features, FedAvg, generator training."""
    counts = participant_counts(hp, data, part)
    pooled = jnp.sum(counts, axis=0)
    prior = pooled / jnp.maximum(jnp.sum(pooled), 1.0)
    inputs = jnp.broadcast_to(prior, counts.shape)
    trained, losses = map_clients(functools.partial(client_update, hp), client_map, state, data, part, inputs)
    average, metrics = part.average(trained, state.global_params)
    heads = trained["params"][hp.head]
    alphas = ensemble_weights(hp.ensemble, counts, part.weights)
    key = jax.random.fold_in(part.sample_key, SERVER_STREAM)
    gen, opt_state, ces = train_generator(hp, state.generator, state.generator_opt, heads, alphas, prior, key)
    if hp.generator_steps > 0:
        metrics = {**metrics, "generator_loss": jnp.mean(ces), "generator_loss_last": ces[-1]}
    return state._replace(global_params=average, generator=gen, generator_opt=opt_state), losses, metrics


def init(model: Model, head: str, sizes, optimizer, key, params_template=None, num_clients: int = 1):
    """The global model (the model's init from `key`) and a fresh generator and Adam state."""
    params = model.initial(key, params_template)
    gen = init_generator(jax.random.fold_in(key, GEN_INIT), *sizes)
    return FedGenState(params, gen, optimizer.init(gen), jnp.zeros([], jnp.int32))


def evaluate(model: Model, client_map, state: FedGenState, data: ClientData, key):
    """The global model on each client's test rows."""
    return evaluate_clients(model.apply, lambda c: state.global_params, data.test, client_map)


DOMAINS = {
    "noise_dim": Domain(1, integer=True),
    "hidden_dim": Domain(1, integer=True),
    "generator_lr": Domain(0, low_open=True),
    "generator_steps": Domain(0, integer=True, note="0: the generator is not trained"),
    "generator_batch": Domain(0, integer=True, note="0: the local batch size"),
    "diversity": Domain(0, note="0: no diversity loss"),
    "generative_alpha": Domain(0, note="0: no generated rows, FedAvg"),
    "generative_beta": Domain(0, note="0: no KL term"),
    "generative_decay": Domain(0, 1, low_open=True, note="1: constant weights"),
}


@checked(DOMAINS)
def build(
    model: Model,
    local: LocalTraining,
    *,
    clients_per_round: int | None = None,
    client_map: ClientMap | str | None = "auto",
    noise_dim: int = 512,
    hidden_dim: int = 512,
    generator_lr: float = 0.005,
    generator_steps: int = 1000,
    generator_batch: int = 0,
    batch_norm: bool = True,
    noise: str = "normal",
    ensemble: str = "label",
    diversity: float = 0.0,
    generative_alpha: float = 1.0,
    generative_beta: float = 0.0,
    generative_decay: float = 1.0,
    weighting: str = "samples",
    privacy: ClientDP | None = None,
) -> Algorithm:
    """FedGen: FedAvg with a server-trained feature generator regularizing the clients' heads.

    Args: see the module docstring; others as fedavg.build. `local` sets the clients'
    optimizer and schedule. Classification only (`local.loss` "cross_entropy").
    """
    check_weighting(weighting)
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    if ensemble not in ENSEMBLES:
        raise ValueError(f"ensemble must be one of {ENSEMBLES}, got {ensemble!r}")
    if not isinstance(batch_norm, bool):
        raise ValueError(f"batch_norm must be True or False, got {batch_norm!r}")
    local = local.validate()
    if get_loss(local.loss).name != "cross_entropy":
        raise ValueError(f"FedGen needs local.loss 'cross_entropy', got {get_loss(local.loss).name!r}")
    cmap = as_client_map(client_map)
    head = linear_head(model, "FedGen")
    d, n = feature_dim(model, head), model.num_outputs
    optimizer = optax.adam(generator_lr, b1=0.9, b2=0.999, eps=1e-8)
    hp = FedGenHyper(
        model,
        head,
        local,
        n,
        noise_dim,
        batch_norm,
        noise,
        ensemble,
        generator_steps,
        generator_batch or local.batch_size,
        diversity,
        generative_alpha,
        generative_beta,
        generative_decay,
        optimizer,
    )
    sizes = (noise_dim, n, hidden_dim, d, batch_norm)
    model_bytes = P.tree_bytes(model.template())
    gen_bytes = 4.0 * (
        (noise_dim + n) * hidden_dim + (2 if batch_norm else 1) * hidden_dim + hidden_dim * d + d
    )
    return Algorithm(
        functools.partial(init, model, head, sizes, optimizer),
        federated_round(
            functools.partial(step, hp, cmap),
            clients_per_round=clients_per_round,
            weighting=weighting,
            privacy=privacy,
            bytes_up=model_bytes + 4.0 * n,  # the model and its label counts
            bytes_down=model_bytes + gen_bytes,  # the model and the generator
        ),
        functools.partial(evaluate, model, cmap),
    )
