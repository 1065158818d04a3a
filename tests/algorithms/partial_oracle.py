"""Reference round for "some leaves personal, the rest averaged" (FedPer, LG-FedAvg,
FedBN, pFedPara), written as a plain per-client Python loop with numpy averaging.

It shares only the local trainer (`make_local_train`), the key derivation and the
client sampler with the library; which leaves are personal is decided by a
predicate on the leaf path written in each test.
"""

from __future__ import annotations

import jax
import numpy as np

from pfljax.core import params as P
from pfljax.core.clients import client_key, round_keys, take
from pfljax.core.local import make_local_train
from pfljax.core.sampling import sample_clients

_TRAINERS = {}


def jitted_trainer(model, spec):
    """One jitted make_local_train per (model, spec), reused across rounds."""
    key = (id(model.apply), id(spec))
    if key not in _TRAINERS:
        _TRAINERS[key] = (model, spec, jax.jit(make_local_train(model.apply, spec)))
    return _TRAINERS[key][2]


def flat(tree) -> dict:
    """{'params/head/kernel': numpy leaf} of a variables dict."""
    return {p: np.asarray(v) for p, v in P.flat(tree).items()}


def loop_round(model, spec, global_vars: dict, personal: list[dict], data, key, round_index, k, is_personal):
    """One round. global_vars and each personal[c] are flat {path: array}; returns new copies.

    Each sampled client trains from the global leaves with its own personal
    leaves; the shared leaves are averaged with weights = train counts; the
    personal leaves of the sampled clients are replaced by what they trained.
    """
    num = len(personal)
    sample_key, train_key = round_keys(key, round_index)
    idx = [int(c) for c in np.asarray(sample_clients(sample_key, num, k))]
    train = jitted_trainer(model, spec)
    template = model.init(jax.random.key(0))
    paths = list(flat(template))
    treedef = jax.tree.structure(template)
    counts = np.asarray(data.train.count, np.float64)
    outs = {}
    for c in idx:
        start = {p: personal[c][p] if is_personal(p) else global_vars[p] for p in paths}
        start = jax.tree.unflatten(treedef, [start[p] for p in paths])
        outs[c] = flat(train(start, take(data.train, c), client_key(train_key, c)).params)
    w = counts[idx] / counts[idx].sum()
    new_global = {
        p: (global_vars[p] if is_personal(p) else sum(wi * outs[c][p] for wi, c in zip(w, idx)))
        for p in paths
    }
    new_personal = [dict(personal[c]) for c in range(num)]
    for c in idx:
        new_personal[c].update({p: outs[c][p] for p in paths if is_personal(p)})
    return new_global, new_personal, idx


def check_against_state(state, global_vars, personal, is_personal, rtol=1e-5, atol=1e-6):
    """state (a FedAvgState) keeps exactly the personal leaves per client, with the
    loop's values, and the loop's shared leaves globally."""
    got_global = flat(state.global_params)
    assert set(state.client_params) == {p for p in got_global if is_personal(p)}
    for p, v in state.client_params.items():
        for c in range(len(personal)):
            np.testing.assert_allclose(np.asarray(v[c]), personal[c][p], rtol=rtol, atol=atol, err_msg=p)
    for p, v in got_global.items():
        if p not in state.client_params:
            np.testing.assert_allclose(v, global_vars[p], rtol=rtol, atol=atol, err_msg=p)


def initial(state, num):
    """(global, personal) flat copies of an initial FedAvgState."""
    g = flat(state.global_params)
    personal = [{p: np.asarray(v[c]) for p, v in state.client_params.items()} for c in range(num)]
    for c in range(num):
        personal[c].update({p: g[p] for p in g if p not in personal[c]})
    return g, personal
