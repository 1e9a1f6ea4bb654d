"""Networks from outside mpt's zoo: a user's own builder function, named `package.module:function`
or `path/to/file.py:function`, and timm's models by name.

A builder is called with `num_classes=` (a classifier: torchvision's and timm's convention) or
`vocab_size=` (a language model) where it takes that argument, and with the model's `kwargs`; it
returns the `nn.Module` to train. A module is imported from the directory the command ran in too, as
`python -m` would find it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ..config import ConfigError

FORM = "package.module:function or path/to/file.py:function"


def parse(spec: str) -> tuple[str, str]:
    """`spec` as (module or file, function), or a one-line error naming it."""
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ConfigError(f"model.builder={spec}: expected {FORM}")
    return where, name


_LOADED: dict[Path, Any] = {}  # a builder's file, executed once per process however often it is named


def _module(where: str, spec: str) -> Any:
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"model.builder={spec}: no file {path}")
        if path not in _LOADED:
            loaded = importlib.util.spec_from_file_location(f"mpt_user_model_{path.stem}", path)
            assert loaded is not None and loaded.loader is not None  # a .py file that exists
            module = importlib.util.module_from_spec(loaded)
            try:
                loaded.loader.exec_module(module)
            except Exception as e:  # the user's file: its error in one line, not a traceback from inside mpt
                raise ConfigError(f"model.builder={spec}: importing {path} failed: {type(e).__name__}: {e}") from None
            sys.modules[loaded.name] = _LOADED[path] = module
        return _LOADED[path]
    if os.getcwd() not in sys.path:  # an installed console script's sys.path lacks the working directory
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and (where == e.name or where.startswith(e.name + ".")):  # the module named is not there
            raise ConfigError(f"model.builder={spec}: no module named {e.name!r} (expected {FORM})") from None
        raise ConfigError(f"model.builder={spec}: importing {where} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # the module itself failed: a missing dependency of its own, a syntax error
        raise ConfigError(f"model.builder={spec}: importing {where} failed: {type(e).__name__}: {e}") from None


def resolve(spec: str) -> Callable[..., Any]:
    """The builder function `spec` names."""
    where, name = parse(spec)
    function = getattr(_module(where, spec), name, None)
    if not callable(function):
        raise ConfigError(f"model.builder={spec}: {where} has no function {name}")
    return function


def _takes(function: Callable[..., Any], argument: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C function: no signature to read
        return False
    return any(p.name == argument or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def build(spec: str, kwargs: dict, size: int | None = None, size_argument: str = "num_classes") -> nn.Module:
    """The network `spec`'s builder makes with `kwargs`, and with `size` as `size_argument` where it
    takes that (a classifier's num_classes, a language model's vocab_size)."""
    function = resolve(spec)
    extra = {size_argument: size} if size is not None and _takes(function, size_argument) else {}
    try:
        net = function(**extra, **kwargs)
    except TypeError as e:
        raise ConfigError(f"model.builder={spec}: calling it with {sorted({**extra, **kwargs})} failed: {e}") from None
    if not isinstance(net, nn.Module):
        raise ConfigError(f"model.builder={spec}: returned a {type(net).__name__}, not a torch.nn.Module")
    return net


def timm_model(name: str, kwargs: dict, num_classes: int) -> nn.Module:
    """timm's `name`, randomly initialized (no download): `pip install "mpt[timm]"`."""
    try:
        import timm
    except ModuleNotFoundError:
        raise ConfigError(f'model=timm model.name={name}: timm is not installed (pip install "mpt[timm]")') from None
    if not timm.is_model(name):
        raise ConfigError(f"model=timm model.name={name}: not a timm model (timm.list_models() lists them)")
    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
    except TypeError as e:
        raise ConfigError(f"model=timm model.name={name}: building it with {sorted(kwargs)} failed: {e}") from None
