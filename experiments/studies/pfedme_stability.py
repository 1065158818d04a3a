"""Why pFedMe diverges under PFLlib's Fashion-MNIST protocol at its MNIST defaults.

    python -m experiments.studies.pfedme_stability [--client=0] [--local_steps=300]

pFedMe's inner solve is K gradient steps of size personal_lr on
f(theta; D) + lam / 2 ||theta - w||^2; gradient descent on it is stable only if
personal_lr * (L + lam) < 2, L the sharpness (largest Hessian eigenvalue) of the
minibatch loss f. This prints, for one client of `pfllib_fmnist.py:dir` and the
FedAvgCNN at initialisation, L on a few batches of 10 (power iteration on
Hessian-vector products) and the largest L each (lam, personal_lr) tolerates,
then runs one client's pFedMe local steps (pfljax.algorithms.pfedme's trainer,
plain SGD 0.005 on w) and prints where, if anywhere, the personal loss stops
being finite. JSON lines.
"""

from __future__ import annotations

import json

import jax
import jax.flatten_util
import jax.numpy as jnp
import optax
from absl import app, flags

from pfljax.algorithms.pfedme import make_moreau_train
from pfljax.core.clients import take
from pfljax.core.local import LocalTraining
from pfljax.core.losses import get_loss
from pfljax.experiment.cli import parse_flags
from pfljax.experiment.config import make_data, make_model, resolve
from pfljax.experiment.configs import pfllib_fmnist

flags.DEFINE_integer("client", 0, "client index")
flags.DEFINE_integer("local_steps", 300, "pFedMe local steps (minibatches) to run")
flags.DEFINE_integer("batches", 5, "batches of 10 to measure the sharpness on")
FLAGS = flags.FLAGS
SETTINGS = ((15.0, 0.1), (15.0, 0.05), (15.0, 0.02), (1.0, 0.01))  # (lam, personal_lr)


def sharpness(loss_fn, params, iters: int = 30, seed: int = 0) -> float:
    """Largest Hessian eigenvalue of loss_fn at params, by power iteration."""
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    grad = jax.grad(lambda p: loss_fn(unravel(p)))
    hvp = jax.jit(lambda v: jax.jvp(grad, (flat,), (v,))[1])
    v = jax.random.normal(jax.random.key(seed), flat.shape)
    eig = 0.0
    for _ in range(iters):
        hv = hvp(v / jnp.linalg.norm(v))
        eig, v = float(jnp.vdot(hv, v) / jnp.linalg.norm(v)), hv
    return eig


def main(argv):
    del argv
    config, _ = resolve(pfllib_fmnist.get_config("dir"))
    fed = make_data(config)
    model = make_model(config, fed)
    data = take(fed.data.train, FLAGS.client)
    variables = model.init(jax.random.key(0))
    ce = get_loss("cross_entropy")
    x, y = data.x, data.y
    for b in range(FLAGS.batches):
        xb, yb = x[10 * b : 10 * b + 10], y[10 * b : 10 * b + 10]

        def loss_fn(p, xb=xb, yb=yb):
            out = model.apply({**variables, "params": p}, xb, train=False)[0]
            return jnp.mean(ce.per_example(out, yb))

        L = sharpness(loss_fn, variables["params"])
        bounds = {f"lam={lam},lr_p={lr}": 2 / lr - lam for lam, lr in SETTINGS}
        print(json.dumps({"batch": b, "sharpness_at_init": round(L, 2), "largest_stable": bounds}))
    for lam, lr in SETTINGS:
        local = LocalTraining(optimizer=optax.sgd(0.005), batch_size=10, steps=FLAGS.local_steps)
        train = jax.jit(make_moreau_train(model.apply, local, lam, 5, lr, 0.0))
        (_, theta), loss = train(variables, data, jax.random.key(0))
        finite = bool(jnp.all(jnp.isfinite(jax.flatten_util.ravel_pytree(theta["params"])[0])))
        print(json.dumps({"lam": lam, "personal_lr": lr, "local_steps": FLAGS.local_steps,
                          "mean_personal_loss": float(loss), "theta_finite": finite}))  # fmt: skip


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
