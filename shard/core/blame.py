"""An exception raised while a model is built or traced, told as one UserError line: what failed, the
exception's type and message, and the line of the user's code it arose at.

Tracing runs the user's model inside JAX and Flax, so the traceback is mostly theirs and ours; the line
that matters is the innermost one outside them (the model's file:line). Only an error with such a line,
or a TypeError/ValueError (JAX's word for shapes and dtypes that do not fit), is the user's to fix; any
other error raised in framework code alone is a bug and keeps its traceback.
"""

import os
import sys
import sysconfig
import traceback
from contextlib import contextmanager

from shard.errors import UserError

LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes", "chex", "orbax")
SHARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESSAGE_LIMIT = 600


@contextmanager
def blamed(what: str):
    """Inside: an exception becomes `UserError("{what}: {Type}: {message} (at file:line ...)")`; a UserError
    passes as it is."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        where = user_frame(e.__traceback__)
        # a kernel's lowering that cannot take these shapes (Pallas: NotImplementedError) is the user's choice too
        if where is None and not isinstance(e, (TypeError, ValueError, NotImplementedError)):
            raise
        at = f" (at {where})" if where else ""
        raise UserError(f"{what}: {describe(e)}{at}{hint(e)}") from None


def describe(e: BaseException) -> str:
    """`Type: message` on one line, long messages cut (JAX's run to pages of pytree diffs)."""
    text = " ".join(str(e).split())
    if len(text) > MESSAGE_LIMIT:
        text = text[:MESSAGE_LIMIT] + " ..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def user_frame(tb) -> str | None:
    """The innermost frame of the user's code in a traceback, as `file:line in function: source`."""
    frames = [f for f in traceback.extract_tb(tb) if is_user_file(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    path = os.path.abspath(f.filename)
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{shown}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def is_user_file(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: nothing a user can open
        return False
    path = os.path.abspath(filename)
    models = sys.modules.get("shard.models")  # our model library is model code: its line is the one to show
    if models is not None and getattr(models, "__file__", None) and inside(path, os.path.dirname(models.__file__)):
        return True
    if inside(path, SHARD):
        return False
    libraries = [os.path.dirname(m.__file__) for name in LIBRARIES
                 if (m := sys.modules.get(name)) is not None and getattr(m, "__file__", None)]
    if any(inside(path, d) for d in libraries):
        return False
    paths = sysconfig.get_paths()
    installed = [paths["purelib"], paths["platlib"]]  # inside the standard library's folder, but not of it
    return not (inside(path, paths["stdlib"]) and not any(inside(path, d) for d in installed))


def inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(os.path.abspath(folder) + os.sep)


def hint(e: BaseException) -> str:
    """What to change, for a mistake whose message does not say it."""
    frames = traceback.extract_tb(e.__traceback__)
    via_bridge = any(f"{os.sep}nnx{os.sep}bridge{os.sep}" in f.filename for f in frames)
    if type(e).__name__ == "ModifyScopeVariableError" and via_bridge:
        return ("; a Linen module wrapped in nnx.bridge.ToNNX updates its variables only when called with "
                "mutable=[their collection]: self.net(x, mutable=['batch_stats']) in training, and in eval a call "
                "that uses the running averages with mutable=False")
    if isinstance(e, NotImplementedError) and any(f"{os.sep}pallas{os.sep}" in f.filename for f in frames):
        return ("; a Pallas kernel's lowering refused these shapes (train.grouped_matmul=tiled and "
                "train.attention=xla take any)")
    return ""
