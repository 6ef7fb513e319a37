"""shard: a JAX SPMD training framework. Models are written once in Flax NNX with logical axis
names; a mesh config alone decides data, tensor, fully sharded or hybrid parallelism."""

import importlib.util
import sys
from pathlib import Path

from shard.errors import UserError

__all__ = ["UserError", "load_model", "load_tokenizer"]


def _load_from_checkout(name: str) -> None:
    """The repository keeps models/ and meshes/ beside shard/, and an install maps them to shard.models
    and shard.meshes. Imported from a checkout that no install maps (`python train.py` before `pip
    install`, or with shard installed from another copy), they load from beside this folder under the
    same names, so there is still one copy of each model class."""
    full, folder = f"{__name__}.{name}", Path(__file__).resolve().parent.parent / name
    if full in sys.modules or not (folder / "__init__.py").is_file() or importlib.util.find_spec(full):
        return
    spec = importlib.util.spec_from_file_location(full, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = sys.modules[full] = globals()[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


for _name in ("models", "meshes"):
    _load_from_checkout(_name)


def load_model(path, *, mesh=None, step=None, trust_code=False):
    """A trained run's Flax NNX module (see shard/use/load.py). Imported on first use: `import shard` stays
    light for the command lines that only parse a config."""
    from shard.use.load import load_model as load

    return load(path, mesh=mesh, step=step, trust_code=trust_code)


def load_tokenizer(path):
    """A trained run's tokenizer (see shard/use/load.py): `encode(text)` and `decode(ids)`."""
    from shard.use.load import load_tokenizer as load

    return load(path)
