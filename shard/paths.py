"""Files: where a run writes, and how a YAML file is read.

A run writes to a local folder, or any URL that etils.epath and Orbax support (gs://, s3://, ...). A URL is kept
as it is end to end (pathlib would turn `gs://bucket/run` into a local `gs:/bucket/run`); a local path is made
absolute, as Orbax wants. Every YAML file (configs, mesh presets, chips, a run's config.yaml) is read by
`yaml_load`: safely, never building a Python object.
"""

import os
import re

import yaml
from etils import epath


def is_remote(path) -> bool:
    return "://" in str(path)


def resolve(path) -> epath.Path:
    if is_remote(path):
        return epath.Path(str(path))
    return epath.Path(os.path.abspath(os.path.expanduser(str(path))))


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, reading numbers as people write them. YAML 1.1 (PyYAML's) takes a float only with
    a dot and a signed exponent, so `1e5`, `1E-4` and `3e+2` would be strings: here they are floats, as in
    YAML 1.2 and Python. Strings, booleans and the rest read as before."""


_NUMBER = re.compile(r"""^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$""")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _NUMBER, list("-+0123456789."))


def yaml_load(text: str):
    """Safe YAML (no Python objects are ever built), with every usual spelling of a number read as one."""
    return yaml.load(text, Loader=_Loader)
