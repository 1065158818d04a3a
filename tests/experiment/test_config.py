"""Every build option is a config field or refused; renamed options name their new name."""

import inspect
import re
import types

import pytest

from pfljax import algorithms
from pfljax.experiment import config as C
from pfljax.experiment import config_fields


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


def test_auto_training_fields_resolve_per_algorithm():
    fedavg, notes = C.resolve(C.base_config())
    assert (fedavg.optimizer, fedavg.learning_rate, fedavg.momentum) == ("sgd", 0.05, 0.9) and notes == []
    config = C.base_config()
    config.algorithm = "federico"
    federico, notes = C.resolve(config)
    assert (federico.optimizer, federico.learning_rate, federico.momentum) == ("adam", 1e-3, 0.0)
    assert notes[0].startswith("federico: optimizer=adam, learning_rate=0.001, momentum=0 (FedeRiCo's paper")
    assert "--config.optimizer" in notes[0]
    assert config.optimizer == "auto" and config.learning_rate is None  # the input is not changed
    config.learning_rate, config.optimizer = 0.3, "sgd"  # explicit values win
    federico, _ = C.resolve(config)
    assert (federico.optimizer, federico.learning_rate, federico.momentum) == ("sgd", 0.3, 0.9)
    config = C.base_config()
    config.algorithm = "pfedme"  # plain SGD, as in its paper: no momentum
    pfedme, notes = C.resolve(config)
    assert (pfedme.optimizer, pfedme.learning_rate, pfedme.momentum) == ("sgd", 0.05, 0.0)
    assert notes[0].startswith("pfedme: optimizer=sgd, learning_rate=0.05, momentum=0 (pFedMe's paper")
    config.optimizer = "adam"  # another optimizer: its own defaults
    assert C.resolve(config)[0].learning_rate == 1e-3


def test_switching_the_model_drops_the_default_mlp_kwargs_only():
    config = C.base_config()
    config.model = "cnn"
    resolved, notes = C.resolve(config)
    assert resolved.model_kwargs.to_dict() == {} and "cnn" in notes[0]
    config.model_kwargs.hidden = (8,)  # not the default: refused, naming the model's arguments
    with pytest.raises(
        C.ConfigError, match=r"model_kwargs.hidden is not an argument of model 'cnn'.*channels="
    ):
        C.resolve(config)
    config.model = "mlp"
    config.model_kwargs.hidden = ("a",)
    with pytest.raises(C.ConfigError, match=r"model_kwargs.hidden=\['a'\] must be a tuple like \(200,\)"):
        C.resolve(config)


def test_a_model_variant_without_an_argument_of_the_model_drops_it_with_a_note():
    from pfljax.experiment.configs import pfllib_fmnist  # pylint: disable=import-outside-toplevel

    config = pfllib_fmnist.get_config("dir")
    assert config.model_kwargs.init_scheme == "torch"
    assert C.resolve(config)[0].model_kwargs.init_scheme == "torch"
    config.algorithm = "factorized_fl"  # trains factorized_cnn: no init_scheme
    resolved, notes = C.resolve(config)
    assert "init_scheme" not in resolved.model_kwargs and resolved.model_kwargs.channels == (32, 64)
    assert any("factorized_cnn" in n and "init_scheme='torch'" in n and "dropped" in n for n in notes)
    config.model_kwargs.rank = 2  # an argument of neither: still refused
    config.algorithm = "fedavg"
    with pytest.raises(C.ConfigError, match=r"model_kwargs.rank is not an argument of model 'cnn'"):
        C.resolve(config)


def test_the_run_says_which_data_and_why(monkeypatch):
    config = C.base_config()
    config.dataset = "fashion_mnist"
    assert C.data_note(config) == f"data: Fashion-MNIST from the IDX files in {C.IDX_DIR}"
    for module in (C, config_fields):  # the run's note and the schema's defaults
        monkeypatch.setattr(module, "fashion_mnist_available", lambda data_dir=C.IDX_DIR: False)
    fallback = C.base_config()
    assert (fallback.dataset, fallback.partition, fallback.samples_per_client) == ("simulation", "iid", 0)
    note = C.data_note(fallback)
    assert (
        "not in /usr/share/datasets/fashion-mnist" in note and "apt-get install dataset-fashion-mnist" in note
    )
    assert "--config.data_dir=DIR" in note
    fallback.partition = "dirichlet"  # README's example on a machine without the files
    with pytest.raises(C.ConfigError, match="partition must be 'iid'.*apt-get install dataset-fashion-mnist"):
        C.make_data(fallback)


def test_a_cap_no_client_reaches_is_reported():
    config = C.base_config()
    config.dataset, config.partition, config.num_clients = "simulation", "iid", 5
    config.source.samples_per_client, config.source.d, config.source.m = 40, 4, 4
    config.samples_per_client = 1000
    fed = C.make_data(config)
    (line,) = C.data_warnings(config, fed)
    assert line.startswith(
        "config.samples_per_client=1000 is a cap, and no client reaches it: 200 samples over 5"
    )
    assert "40..40" in line
    config.samples_per_client = 30
    assert C.data_warnings(config, C.make_data(config)) == []


def test_a_cap_that_evens_out_a_non_iid_split_is_reported():
    import types  # noqa: PLC0415

    config = C.base_config()
    config.partition, config.samples_per_client = "dirichlet", 100
    clients = [{"train": 80, "test": 20}] * 3 + [{"train": 40, "test": 10}]
    fed = types.SimpleNamespace(summary={"clients": clients})
    assert C.data_warnings(config, fed) == [
        "config.samples_per_client=100 cuts 3 of 4 clients of the 'dirichlet' split to 100 samples "
        "each, so client sizes are no longer the split's; --config.samples_per_client=0 lifts the cap"
    ]
    for split in ("iid", "classes", "shards"):  # sizes are not what these splits define
        config.partition = split
        assert C.data_warnings(config, fed) == []
    config.partition, config.samples_per_client = "dirichlet", 0
    assert C.data_warnings(config, fed) == []
    if not C.fashion_mnist_available():
        return
    config = C.base_config()
    config.dataset, config.partition, config.num_clients = "fashion_mnist", "dirichlet", 10
    config.samples_per_client, config.dirichlet_alpha = 1000, 0.3
    (line,) = C.data_warnings(config, C.make_data(config))
    assert line.startswith("config.samples_per_client=1000 cuts 10 of 10 clients of the 'dirichlet' split")
    default = C.resolve(C.base_config())[0]  # its own cap on its classes split: nothing to warn of
    assert C.data_warnings(default, C.make_data(default)) == []


def test_an_unknown_tfds_name_is_one_short_line_with_close_names(monkeypatch):
    """TFDS lists all its ~450 data sets in the error: cut to the closest names.
    (tensorflow_datasets is replaced by a stub: importing it takes seconds.)"""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    names = ["cifar10", "cifar100", "cifar10_corrupted", "mnist", *[f"set_{i}" for i in range(440)]]
    monkeypatch.setitem(
        sys.modules, "tensorflow_datasets", types.SimpleNamespace(list_builders=lambda: names)
    )
    config = C.base_config()
    config.dataset = "tfds:cifar1O"
    long = ValueError(
        "dataset='tfds:cifar1O' is not a TFDS data set known to tensorflow_datasets: " + "x\n" * 4000
    )
    e = C._data_error(config, long)
    assert str(e) == (
        "config.dataset='tfds:cifar1O': TFDS has no data set 'cifar1O' "
        "(did you mean 'cifar10' or 'cifar100'?) "
        "(444 known: tfds.list_builders())"
    )


def test_pfllib_fmnist_config_is_pfllibs_setting_and_bad_values_name_the_field():
    from pfljax.experiment.configs import pfllib_fmnist  # pylint: disable=import-outside-toplevel

    for arg, partition in (("dir", "pfllib_dirichlet"), ("pat", "pfllib_pathological")):
        config = pfllib_fmnist.get_config(arg)
        C.validate(config)
        assert config.partition == partition and config.data_seed == 1
        assert (config.num_clients, config.clients_per_round, config.test_fraction) == (20, 0, 0.25)
        assert (config.optimizer, config.learning_rate, config.momentum) == ("sgd", 0.005, 0.0)
        assert (config.batch_size, config.local_epochs, config.rounds, config.eval_every) == (10, 1, 2000, 1)
    assert pfllib_fmnist.get_config("dir").dirichlet_alpha == 0.1
    assert pfllib_fmnist.get_config("pat").classes_per_client == 2
    with pytest.raises(ValueError, match=r"one of \('dir', 'pat'\); got 'exdir'"):
        pfllib_fmnist.get_config("exdir")
    config = pfllib_fmnist.get_config("dir")
    config.partition = "pfllib_dirichle"
    with pytest.raises(C.ConfigError) as e:
        C.validate(config)
    message = str(e.value)
    assert "\n" not in message and message.startswith("config.partition must be one of")
    assert "'pfllib_dirichlet'" in message and "'pfllib_pathological'" in message


def test_pfllib_mode_fields_reach_the_data_and_local_training_and_bad_values_name_the_field():
    """test_split, source.pixel_scale and drop_last: defaults keep the earlier behaviour,
    pfllib_fmnist sets PFLlib's; make_local / make_data pass them on; bad values are refused."""
    from pfljax.experiment.configs import pfllib_fmnist  # pylint: disable=import-outside-toplevel

    base = C.base_config()
    assert (base.test_split, base.source.pixel_scale, base.drop_last) == ("stratified", None, False)
    config = pfllib_fmnist.get_config("pat")
    assert (config.test_split, config.source.pixel_scale, config.drop_last) == ("pfllib", "symmetric", True)
    assert C.make_local(config).drop_last and not C.make_local(base).drop_last
    for field in ("test_split", "drop_last"):
        assert field in C.FIELD_HELP
    bad = (("test_split", "sklearn", "config.test_split must be one of ('stratified', 'pfllib')"),)
    bad += (("drop_last", None, "config.drop_last must be True or False, got None"),)
    for field, value, message in bad:
        wrong = pfllib_fmnist.get_config("dir")
        with wrong.ignore_type():
            wrong[field] = value
        with pytest.raises(C.ConfigError, match=re.escape(message)):
            C.validate(wrong)
    wrong = pfllib_fmnist.get_config("dir")
    wrong.source.pixel_scale = "half"
    with pytest.raises(C.ConfigError, match=re.escape("config.source.pixel_scale must be one of ('unit',")):
        C.validate(wrong)
    wrong.dataset, wrong.source.pixel_scale = "simulation", "symmetric"
    with pytest.raises(
        C.ConfigError, match="config.source.pixel_scale='symmetric' is not an option of dataset"
    ):
        C.validate(wrong)
