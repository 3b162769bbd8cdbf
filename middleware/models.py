"""Models named on the command line: ``torchvision:NAME`` or ``path/to/file.py:ATTRIBUTE``.

``torchvision:NAME`` builds ``torchvision.models.NAME`` with random weights (seeded) in eval
mode; googlenet and inception_v3 without their auxiliary heads. ``file.py:ATTRIBUTE``
imports the file and takes ``ATTRIBUTE``: an ``nn.Module`` instance, an ``nn.Module``
class (built with no arguments), or a function of no arguments returning a module or a
``(module, input_shape)`` pair, ``input_shape`` being one sample's shape (no batch dim).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

DEFAULT_INPUT_SHAPE = (3, 224, 224)
# The eleven torchvision networks the project's tests and benchmarks cover.
NETWORKS: tuple[str, ...] = (
    "alexnet",
    "vgg16",
    "resnet18",
    "resnet50",
    "densenet121",
    "squeezenet1_1",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "googlenet",
    "inception_v3",
    "shufflenet_v2_x1_0",
)
# torchvision constructors that need arguments to build the inference-only variant
_TORCHVISION_KWARGS: dict[str, dict[str, Any]] = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
}
_TORCHVISION_INPUT: dict[str, tuple[int, ...]] = {"inception_v3": (3, 299, 299)}


class ModelSpecError(ValueError):
    """A model spec that names nothing loadable; the message lists the accepted forms."""


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: in eval mode, with the shape of one input sample."""

    name: str
    model: nn.Module
    input_shape: tuple[int, ...]

    def example(self, batch: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A seeded random input batch of ``batch`` samples."""
        g = torch.Generator().manual_seed(1)
        return torch.randn((batch, *self.input_shape), generator=g).to(device)


def load_model(spec: str, seed: int = 0, input_shape: tuple[int, ...] | None = None) -> LoadedModel:
    """Build the model named by ``spec`` (see the module docstring), in eval mode.

    Raises :class:`ModelSpecError` (a ``ValueError``) with the accepted forms when ``spec`` names nothing loadable.
    ``input_shape`` overrides the model's default sample shape.
    """
    torch.manual_seed(seed)
    kind, sep, name = spec.rpartition(":")
    if not sep or not kind or not name:
        raise ModelSpecError(
            f"cannot read model {spec!r}: use torchvision:NAME (e.g. torchvision:resnet18) "
            "or path/to/file.py:NAME"
        )
    if kind == "torchvision":
        loaded = _torchvision(name)
    else:
        loaded = _from_file(Path(kind), name)
    loaded.model.eval()
    if input_shape is not None:
        loaded.input_shape = tuple(input_shape)
    return loaded


def torchvision_names() -> list[str]:
    """The classification models torchvision can build here."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def _torchvision(name: str) -> LoadedModel:
    try:
        import torchvision
    except ImportError as e:
        raise ModelSpecError(
            "torchvision:... models need torchvision (pip install torchvision)"
        ) from e
    names = torchvision_names()
    if name not in names:
        raise ModelSpecError(f"torchvision has no model {name!r}; choose one of {', '.join(names)}")
    model = torchvision.models.get_model(name, weights=None, **_TORCHVISION_KWARGS.get(name, {}))
    return LoadedModel(name, model, _TORCHVISION_INPUT.get(name, DEFAULT_INPUT_SHAPE))


def _from_file(path: Path, attr: str) -> LoadedModel:
    if not path.is_file():
        raise ModelSpecError(f"no such file {str(path)!r} (model spec path/to/file.py:NAME)")
    mod_name = f"_middleware_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # lets pickling/dataclasses inside the file work
    spec.loader.exec_module(module)
    if not hasattr(module, attr):
        found = [k for k, v in vars(module).items() if _loadable(v) and not k.startswith("_")]
        raise ModelSpecError(
            f"{str(path)!r} has no {attr!r}; it defines: {', '.join(found) or 'nothing loadable'}"
        )
    obj = getattr(module, attr)
    shape: tuple[int, ...] = DEFAULT_INPUT_SHAPE
    if inspect.isclass(obj) and issubclass(obj, nn.Module):
        model = obj()
    elif isinstance(obj, nn.Module):
        model = obj
    elif callable(obj):
        made = obj()
        if isinstance(made, tuple) and len(made) == 2:
            made, shape = made[0], tuple(made[1])
        model = made
    else:
        raise ModelSpecError(f"{path}:{attr} is a {type(obj).__name__}, not a module or a function")
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{path}:{attr} gave a {type(model).__name__}, not a torch.nn.Module")
    return LoadedModel(f"{path.name}:{attr}", model, shape)


def _loadable(v: Any) -> bool:
    return (
        isinstance(v, nn.Module)
        or (inspect.isclass(v) and issubclass(v, nn.Module))
        or inspect.isfunction(v)
    )
