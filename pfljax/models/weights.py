"""A model's starting variables from a file (`config.init_params`): `load_variables`.

The file is a .npz of arrays in one of two layouts, told apart by their keys:

- flax: the variables' paths joined by "/" ("params/conv_0/kernel",
  "batch_stats/bn_0/mean"), as `save_variables` writes them;
- torch: a torch module's `state_dict` ("conv1.0.weight", "fc.bias"), saved as
  `np.savez(path, **{k: v.numpy() for k, v in module.state_dict().items()})`.
  Its Conv2d and Linear layers are matched in order to the model's `conv_i`,
  `hidden_i` / `dense_i` and `head` layers (pfljax's CNN and MLP): conv weights
  [O, I, kh, kw] become kernels [kh, kw, I, O], Linear weights are transposed,
  and the first Linear after the convolutions (or on an image input) has its
  inputs reordered from torch's NCHW flattening to flax's NHWC one. With it,
  pfljax starts from the very weights another library drew (e.g. PFLlib's
  FedAvgCNN after its `torch.manual_seed`).
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping

import jax
import numpy as np
from flax.traverse_util import flatten_dict

from pfljax.models.base import Model, Variables


def flat(variables: Variables) -> dict:
    """{'params/head/kernel': leaf} of a variables dict, in tree-flatten (sorted key) order."""
    return {"/".join(path): leaf for path, leaf in sorted(flatten_dict(variables).items())}


LAYER_KINDS = {"conv": 0, "hidden": 1, "dense": 1, "head": 2}


def layer_order(name: str) -> tuple[int, int]:
    """Sort key of a CNN / MLP layer name: convs, then dense layers, then the head."""
    kind, _, index = name.partition("_")
    if kind not in LAYER_KINDS or not (index.isdigit() or (kind == "head" and not index)):
        raise ValueError(f"layer {name!r} is not one of conv_i, hidden_i, dense_i, head")
    return LAYER_KINDS[kind], int(index or 0)


def save_variables(path: str, variables: Variables) -> None:
    """Writes `variables` to `path` (.npz) in the flax layout `load_variables` reads."""
    np.savez(path, **{k: np.asarray(v) for k, v in flat(variables).items()})


def _unflatten(flat: Mapping[str, np.ndarray]) -> Variables:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def from_torch_state(state: Mapping[str, np.ndarray], template: Variables, input_shape) -> Variables:
    """The flax variables of `template`'s structure holding a torch state_dict's
    Conv2d / Linear weights (module docstring); ValueError naming what does not fit."""
    if set(template) != {"params"}:
        raise ValueError(
            "the torch layout fills Conv2d / Linear weights only; this model also has "
            f"{sorted(set(template) - {'params'})}"
        )
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in state.items():
        module, _, kind = key.rpartition(".")
        if kind not in ("weight", "bias"):
            raise ValueError(f"torch key {key!r}: only Conv2d / Linear weights and biases can be read")
        modules.setdefault(module, {})[kind] = np.asarray(value)
    names = sorted(template["params"], key=layer_order)
    if len(names) != len(modules):
        raise ValueError(
            f"{len(modules)} torch layers ({', '.join(modules)}) for the model's {len(names)} "
            f"({', '.join(names)})"
        )
    channels = input_shape[-1] if len(input_shape) == 3 else 0  # > 0 while inputs are NHWC maps
    params = {}
    for name, (module, tensors) in zip(names, modules.items()):
        want = template["params"][name]
        weight = tensors.get("weight")
        if weight is None or ("bias" in want) != ("bias" in tensors):
            raise ValueError(
                f"torch layer {module!r} ({sorted(tensors)}) does not fit layer {name!r} ({sorted(want)})"
            )
        if weight.ndim not in (2, 4):
            raise ValueError(
                f"torch layer {module!r}: weight of rank {weight.ndim} (Conv2d or Linear expected)"
            )
        # conv [O, I, kh, kw] -> [kh, kw, I, O]; Linear [out, in] -> [in, out]
        kernel = weight.transpose(2, 3, 1, 0) if weight.ndim == 4 else weight.T
        layer = {"kernel": kernel, **({"bias": tensors["bias"]} if "bias" in tensors else {})}
        for leaf, value in layer.items():
            if value.shape != tuple(want[leaf].shape):
                raise ValueError(
                    f"torch layer {module!r} gives {name}/{leaf} shape {value.shape}, "
                    f"the model's is {tuple(want[leaf].shape)}"
                )
        if weight.ndim == 4:
            channels = weight.shape[0]
        elif channels:  # the inputs flattened as (C, H, W) by torch, as (H, W, C) by flax
            out, size = weight.shape
            layer["kernel"] = (
                weight.reshape(out, channels, size // channels).transpose(2, 1, 0).reshape(size, out)
            )
            channels = 0
        params[name] = layer
    return {"params": params}


def load_variables(path: str, model: Model) -> Variables:
    """The variables in the .npz at `path` (flax or torch layout, module docstring),
    checked against `model`'s shapes and cast to its dtypes; ValueError if they do not fit."""
    if not zipfile.is_zipfile(path):
        raise ValueError(f"cannot read a .npz from {path!r}: not a zip archive as np.savez writes")
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    template = model.template()
    if not arrays:
        raise ValueError(f"{path!r} holds no arrays")
    if all("/" in k for k in arrays):
        variables = _unflatten(arrays)
    elif not any("/" in k for k in arrays):
        variables = from_torch_state(arrays, template, model.input_shape)
    else:
        raise ValueError(f"{path!r} mixes flax ('a/b') and torch ('a.b') keys")
    want, got = flat(template), flat(variables)
    if set(want) != set(got):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ValueError(
            f"{path!r} does not hold the model's variables: missing {missing}, unexpected {extra}"
        )
    for key, t in want.items():
        if tuple(got[key].shape) != tuple(t.shape):
            raise ValueError(
                f"{path!r}: {key} has shape {tuple(got[key].shape)}, the model's is {tuple(t.shape)}"
            )
    return jax.tree.map(lambda v, t: np.asarray(v, t.dtype), variables, template)
