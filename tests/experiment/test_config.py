"""Every build option is a config field or refused; renamed options name their new name."""

import inspect
import types

import pytest

from pfljax import algorithms
from pfljax.experiment import config as C


@pytest.mark.parametrize("name", algorithms.available())
def test_every_build_option_is_a_config_field(name):
    params = inspect.signature(algorithms.get(name).build).parameters
    options = [
        p.name
        for p in params.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in C.COMMON_BUILD_ARGS
    ]
    fields = C.algorithm_options(name)
    assert sorted(fields) == sorted(options)
    assert all(fields[o] == params[o].default for o in options)


def test_an_option_that_cannot_be_a_config_field_is_refused(monkeypatch):
    def build(model, local, *, clients_per_round=None, client_map="auto", schedule=lambda r: r):
        del model, local, clients_per_round, client_map, schedule

    monkeypatch.setattr(algorithms, "get", lambda name: types.SimpleNamespace(build=build))
    with pytest.raises(ValueError, match="option 'schedule' has default"):
        C.algorithm_options("fake")


def test_renamed_option_names_the_new_one():
    assert algorithms.renamed_option("fedper", "personal_layers") == "local_layers"
    assert algorithms.renamed_option("fedper", "local_layers") is None
    assert algorithms.renamed_option("nosuch", "x") is None
