"""README's "Use from your own JAX code" example runs as written; importing pfljax stays light."""

import contextlib
import io
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_example() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Use from your own JAX code") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_and_learns():
    namespace = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(readme_example(), "README.md", "exec"), namespace)  # noqa: S102
    per_client = namespace["per_client"]
    assert per_client["accuracy"].shape == (20,)
    assert "mean_accuracy" in out.getvalue()
    assert int(namespace["state"].round) == 20
    # Training lowered the test loss of the initial model.
    jax, alg, fd = namespace["jax"], namespace["alg"], namespace["fd"]
    before = jax.device_get(
        namespace["evaluate"](alg.init(jax.random.key(0), None, 20), fd.data, jax.random.key(2))
    )

    def weighted(m):
        return np.sum(m["loss"] * m["count"]) / np.sum(m["count"])

    assert weighted(per_client) < weighted(before) - 0.01, (weighted(per_client), weighted(before))


def test_import_pfljax_is_light():
    code = (
        "import sys, pfljax; heavy = [m for m in ('tensorflow', 'orbax', 'matplotlib', 'tensorboardX',"
        " 'pfljax.experiment') if m in sys.modules]; print(heavy); assert not heavy;"
        " assert callable(pfljax.fedavg.build) and callable(pfljax.train_and_evaluate)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_every_algorithm_is_reexported_and_readme_table_is_current():
    import pfljax  # noqa: PLC0415

    for name in pfljax.algorithms.available():
        assert getattr(pfljax, name) is pfljax.algorithms.get(name), name
    text = open(os.path.join(ROOT, "README.md")).read()
    table = text[text.index("<!-- algorithms:begin -->\n") + 26 : text.index("\n<!-- algorithms:end -->")]
    assert table == pfljax.algorithms.readme_table(), (
        "README's table of algorithms is out of date: run `python -m pfljax.algorithms` and paste it "
        "between the algorithms:begin/end markers"
    )
