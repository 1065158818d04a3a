"""One domain per numeric option (pfljax.core.domains), checked by `config.validate`.

The cases are generated from the declared domains (and the config schema), so a new
numeric option without a domain, or a domain the check does not enforce, fails here.
Validation only: nothing is built or trained.
"""

import copy
import math

import jax
import ml_collections
import optax
import pytest

from pfljax import algorithms
from pfljax.algorithms import fedprox
from pfljax.core.domains import Domain, checked
from pfljax.core.local import LocalTraining
from pfljax.experiment import config as C
from pfljax.models import build_model

SCHEMA = C.base_config()
SCHEMA.dataset = "simulation"  # a source option of another data set is set with that data set
PLAIN = SCHEMA.to_dict()
DOMAINS = C.numeric_domains(SCHEMA)


def is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def numeric_fields(config, prefix=""):
    """Dotted names of the schema's numeric fields: numbers (or unset numbers) and
    tuples of numbers; model_kwargs are the model's arguments, checked against it."""
    for key in config.keys():
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict):
            if key != "model_kwargs":
                yield from numeric_fields(value, f"{prefix}{key}.")
        elif config.get_type(key) in (int, float) or (
            isinstance(value, tuple) and value and all(is_number(v) for v in value)
        ):
            yield prefix + key


def with_value(field: str, value) -> ml_collections.ConfigDict:
    """The schema with config.<field> = value (a tuple field gets (value,)); built from
    a dict, so an integer field can hold a float."""
    plain = copy.deepcopy(PLAIN)
    *groups, option = field.split(".")
    node = plain
    for g in groups:
        node = node[g]
    node[option] = (value,) if isinstance(node[option], tuple) else value
    if groups == ["source"] and option not in C.SOURCE_OPTIONS[plain["dataset"]]:
        plain["dataset"] = next(d for d, opts in C.SOURCE_OPTIONS.items() if option in opts)
    return ml_collections.ConfigDict(plain)


def outside(domain: Domain) -> list:
    """Values outside `domain`: past each end, non-finite, non-integer."""
    bad = [math.nan, -math.inf]
    if not (domain.high == math.inf and not domain.high_open):
        bad.append(math.inf)
    if domain.low is not None:
        bad.append(domain.low if domain.low_open else domain.low - 1)
    if domain.high is not None and domain.high != math.inf:
        bad.append(domain.high if domain.high_open else domain.high + 1)
    if domain.integer:
        bad.append((domain.low or 0) + 0.5)
    return bad


def test_every_numeric_option_has_a_domain_holding_its_default():
    fields = set(numeric_fields(SCHEMA))
    assert {"rounds", "source.p", "dp.clip_norm", "fedprox.mu", "pfedhn.hn_hidden"} <= fields
    missing = sorted(fields - set(DOMAINS))
    assert not missing, f"numeric options without a declared domain: {missing}"
    assert not sorted(set(DOMAINS) - fields)  # and no domain of a field that is not there
    for field, domain in DOMAINS.items():
        default = C._lookup(SCHEMA, field)
        if default is not None:  # unset (None): not checked
            assert domain.error(field, default) is None, (field, default)


@pytest.mark.parametrize("field", sorted(DOMAINS))
def test_a_value_outside_the_domain_is_refused_naming_the_option(field):
    domain = DOMAINS[field]
    for value in outside(domain):
        assert not domain.contains(value)
        with pytest.raises(C.ConfigError) as e:
            C.validate(with_value(field, value))
        message = str(e.value)
        assert message.startswith(f"config.{field} must be "), (value, message)
        assert "\n" not in message and "got " in message


@pytest.mark.parametrize("field", [k for k in PLAIN["dp"] if k != "enabled"])
def test_a_dp_option_set_while_dp_is_disabled_is_refused(field):
    default, domain = PLAIN["dp"][field], DOMAINS[f"dp.{field}"]
    value = next(v for v in (default + 1, default / 2, 0.5) if v != default and domain.contains(v))
    config = with_value(f"dp.{field}", value)
    with pytest.raises(
        C.ConfigError, match=rf"^config.dp.{field}={value!r} is set but config.dp.enabled is False"
    ):
        C.validate(config)
    config.dp.enabled = True
    C.validate(config)


def test_domain_text_and_membership():
    assert Domain(1, integer=True).describe() == "an integer >= 1"
    assert Domain(0, 1, low_open=True).describe() == "in (0, 1]"
    assert Domain(0, note="0: none").describe() == ">= 0 (0: none)"
    assert Domain().describe() == "a finite number"
    clip = Domain(0, math.inf, low_open=True)
    assert clip.contains(math.inf) and not clip.contains(0.0) and not Domain(0).contains(math.inf)
    assert not Domain(1, integer=True).contains(2.0) and not Domain(0).contains(True)
    # An integer out of bounds is told the bounds; a non-integer, the kind.
    assert Domain(0, 6, integer=True).error("k", 7) == "k must be in [0, 6], got 7"
    assert Domain(0, 6, integer=True).error("k", 1.5) == "k must be an integer in [0, 6], got 1.5"


def test_build_checks_concrete_values_and_skips_traced_ones():
    model = build_model("mlp", (4,), 3, hidden=(5,))
    local = LocalTraining(optax.sgd(0.1), batch_size=2, steps=1)
    with pytest.raises(ValueError, match=r"^mu must be > 0, got -1.0$"):
        fedprox.build(model, local, mu=-1.0)
    # A grid's value is a tracer: not checked in build (its config was).
    jax.make_jaxpr(lambda mu: fedprox.build(model, local, mu=mu) and mu)(-1.0)
    assert algorithms.domains("fedprox")["mu"] == Domain(0, low_open=True)
    with pytest.raises(TypeError, match="domains of unknown options"):
        checked({"nope": Domain(0)})(fedprox.build)


@pytest.mark.parametrize("field", C.SERVER_FIELDS)
def test_a_server_option_set_without_a_server_optimizer_is_refused(field):
    domain = DOMAINS[field]
    value = next(v for v in (0.5, 0.25) if v != PLAIN[field] and domain.contains(v))
    config = with_value(field, value)
    with pytest.raises(C.ConfigError, match=rf"^config.{field}={value!r} is set but config.server_optimizer"):
        C.validate(config)
    config.server_optimizer = "adam"
    C.validate(config)
