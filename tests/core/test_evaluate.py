import jax.numpy as jnp
import numpy as np

from pfljax.core.evaluate import predict_rows, scores_from_outputs, summarize
from pfljax.core.types import ClientArrays


def test_scores_ignore_padding():
    logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [9.0, 0.0]])
    data = ClientArrays(jnp.zeros((4, 1)), jnp.array([0, 1, 1, 1]), jnp.int32(3))
    s = scores_from_outputs(logits, data)
    np.testing.assert_allclose(s["accuracy"], 2 / 3, rtol=1e-6)


def test_predict_rows_chunks_match_full():
    x = jnp.arange(30.0).reshape(10, 3)
    out = predict_rows(lambda xb: xb.sum(-1), x, chunk=4)
    np.testing.assert_allclose(out, np.arange(30.0).reshape(10, 3).sum(-1))


def test_summarize_weighted_std_worst():
    per = {
        "accuracy": np.array([0.5, 1.0, 0.9, 0.8, 0.7, 0.6, 0.9, 0.95, 1.0, 0.2]),
        "loss": np.ones(10),
        "count": np.array([10, 30, 10, 10, 10, 10, 10, 10, 10, 10]),
    }
    s = summarize(per)
    w = per["count"] / per["count"].sum()
    np.testing.assert_allclose(s["mean_accuracy"], np.sum(w * per["accuracy"]))
    np.testing.assert_allclose(s["worst10_accuracy"], 0.2)
    np.testing.assert_allclose(s["std_accuracy"], np.std(per["accuracy"]))
