"""Where a run writes: a local folder, or any URL that etils.epath and Orbax support (gs://, s3://, ...).

A URL is kept as it is end to end (pathlib would turn `gs://bucket/run` into a local `gs:/bucket/run`);
a local path is made absolute, as Orbax wants.
"""

import os

from etils import epath


def is_remote(path) -> bool:
    return "://" in str(path)


def resolve(path) -> epath.Path:
    if is_remote(path):
        return epath.Path(str(path))
    return epath.Path(os.path.abspath(os.path.expanduser(str(path))))
