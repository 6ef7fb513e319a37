"""Find the model class named by `model.name` and check `model.*` arguments against its signature.

`model.name` is a name from shard.models.REGISTRY or any importable `package.module:Class`, so a user's
own Flax NNX module trains through the framework without changes to it. Importing a module runs its code,
so a name read back from a run folder (load_model, generate, export) is imported only when the caller
trusts it (`trust_code=True`, `--trust-code`); a name the user gives train.py is their own choice.
"""

import importlib
import importlib.util
import inspect
import os
import sys
import typing

from shard.errors import UserError

LIBRARY = "shard.models"  # the model library's package (the repository's models/ folder)


def load(model_cfg, trusted: bool = True, source: str = "") -> tuple[type, dict]:
    """The class `model.name` names and the `model.*` arguments, checked against its signature.
    `trusted=False`: only the model library's names; `source` says where the name was read (for the refusal)."""
    cls = resolve(model_cfg.name, trusted, source)
    return cls, check_kwargs(cls, model_cfg.kwargs, model_cfg.name)


def resolve(name: str, trusted: bool = True, source: str = "") -> type:
    from shard.models import REGISTRY

    target = _library_path(REGISTRY.get(name, name))
    if ":" not in target:
        raise UserError(f"unknown model {name!r}; registered models: {', '.join(sorted(REGISTRY))}, "
                        "or give package.module:Class")
    module_name, _, class_name = target.partition(":")
    if not trusted and name not in REGISTRY and not _in_library(module_name):
        raise UserError(f"{source or 'the run'} names model {name!r}, a module outside the model library: importing "
                        "it would run its code; pass trust_code=True (--trust-code on the command line) if you "
                        "trust it")
    try:
        module = _import(module_name)
    except (ImportError, ValueError, TypeError) as e:  # also '' or '..x' as a module name
        raise UserError(f"model.name={name!r}: cannot import module {module_name!r} ({e})") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UserError(f"model.name={name!r}: module {module_name!r} has no class {class_name!r}")
    if "rngs" not in inspect.signature(cls.__init__).parameters:
        raise UserError(f"model.name={name!r}: the class must take an `rngs` argument (nnx.Rngs) to initialise "
                        "its parameters")
    return cls


def _library_path(target: str) -> str:
    """The library was installed as a top-level `models` package before it moved under shard: run
    folders from then may name `models.gpt:GPT`, which is now `shard.models.gpt:GPT`. Only the
    library's modules move; a user's own `models.mynet` (a module the library lacks) keeps its name."""
    parts = target.partition(":")[0].split(".")
    if len(parts) > 1 and parts[0] == "models" and parts[1].isidentifier() \
            and importlib.util.find_spec(f"{LIBRARY}.{parts[1]}"):
        return f"shard.{target}"
    return target


def _in_library(module_name: str) -> bool:
    """Our own modules: importing them runs no code from outside the framework, so no trust is needed."""
    return module_name == LIBRARY or module_name.startswith(LIBRARY + ".")


def _import(module_name: str):
    """Like `python -m`, the user's own modules import from the working directory; sys.path is put back after."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def arguments(cls: type) -> list[tuple[str, str, object]]:
    """(name, type, default) of each constructor argument a config may set."""
    out = []
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name in ("self", "rngs") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tname = getattr(p.annotation, "__name__", str(p.annotation)) if p.annotation is not p.empty else "any"
        out.append((p.name, tname, "(required)" if p.default is p.empty else p.default))
    return out


def check_kwargs(cls: type, kwargs: dict, name: str) -> dict:
    """The kwargs, checked against the signature: unknown names, missing required ones, plain types."""
    params = {p.name: p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name not in ("self", "rngs") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())
    for key, value in kwargs.items():
        if key not in params:
            if takes_any:
                continue
            raise UserError(f"model {name!r} has no argument 'model.{key}'; it accepts: {', '.join(params) or 'none'}")
        _check_type(name, key, value, params[key].annotation, cls)
    missing = [k for k, p in params.items() if p.default is p.empty and k not in kwargs]
    if missing:
        raise UserError(f"model {name!r} needs {', '.join('model.' + k for k in missing)}")
    return kwargs


def _check_type(model: str, key: str, value, annotation, cls) -> None:
    if isinstance(annotation, str):  # postponed annotations
        try:
            annotation = typing.get_type_hints(cls.__init__).get(key, annotation)
        except Exception:
            return
    plain = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}
    allowed = plain.get(annotation)
    if allowed is None:
        return  # containers, unions, custom types: the class checks them itself
    if not isinstance(value, allowed) or (annotation is int and isinstance(value, bool)):
        raise UserError(f"model.{key}={value!r}: model {model!r} expects {annotation.__name__}")


def with_defaults(cls: type, kwargs: dict) -> dict:
    """Every constructor argument with its value: the given ones over the signature's defaults."""
    defaults = {name: default for name, _, default in arguments(cls)
                if default != "(required)" and _plain(default)}  # dtypes, functions: not config values
    return {**defaults, **kwargs}


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))
