"""The model library and the mesh presets install as shard.models and shard.meshes, so a user's own
packages called `models` or `meshes` do not clash with them."""

import subprocess
import sys
import textwrap
import tomllib

from conftest import ROOT, TINY_GPT, subprocess_env

# The user's own packages, named like the repository's folders: a `models.gpt` with a GPT of its own
# (the library's old path must still mean the library's), a model of theirs, and presets of theirs.
USER_FILES = {
    "models/__init__.py": "MINE = True\n",
    "models/gpt.py": "class GPT:\n    def __init__(self, *, rngs): pass\n",
    "models/mynet.py": "class Net:\n    def __init__(self, width: int = 4, *, rngs): pass\n",
    "meshes/__init__.py": "MINE = True\n",
    "meshes/tp.yaml": "data: 3\n",
}

CHECK = textwrap.dedent("""
    import models, meshes, pytest
    from shard.core import mesh, registry
    from shard.errors import UserError
    from shard.models.gpt import GPT

    assert models.MINE and meshes.MINE  # the user's packages import as before
    assert registry.resolve("gpt") is GPT and GPT.__module__ == "shard.models.gpt"
    # a run folder from before the move names the library's old path: still the library's class, no trust needed
    assert registry.resolve("models.gpt:GPT", trusted=False) is GPT
    # a module the library lacks stays the user's own, and importing it needs their trust
    assert registry.resolve("models.mynet:Net").__module__ == "models.mynet"
    with pytest.raises(UserError, match="outside the model library"):
        registry.resolve("models.mynet:Net", trusted=False)
    assert mesh.load_preset("tp") == {"tensor": -1} and "fsdp_tp" in mesh.preset_names()
    print("ok")
""")


def user_packages(tmp_path):
    for name, text in USER_FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    return {**subprocess_env(), "PYTHONPATH": str(tmp_path)}


def test_a_user_s_models_and_meshes_packages_do_not_hide_the_library(tmp_path):
    env = user_packages(tmp_path)
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # cwd: the user's folder is first on sys.path
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY_GPT, "mesh=tp", "--print-config"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "  preset: tp\n" in proc.stdout and "  tensor: -1\n" in proc.stdout and "  n_heads: 8\n" in proc.stdout


def test_a_checkout_no_install_maps_still_has_the_library_under_shard():
    """Without site-packages (so no install's mapping; and no JAX, hence no model is built), train.py's
    folder still provides shard.models and shard.meshes, from beside shard/, and only under those names."""
    code = ("import sys; sys.path.insert(0, '.'); import importlib.resources, importlib.util, shard.models; "
            "assert importlib.util.find_spec('shard.models.gpt').origin.startswith(sys.argv[1]); "
            "assert 'models' not in sys.modules and 'meshes' not in sys.modules; "
            "print(sorted(p.name for p in importlib.resources.files('shard.meshes').iterdir())[-1])")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT / "models")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "zero2.yaml\n", proc.stderr


def test_pyproject_lists_every_package_of_shard():
    """Packages mapped from other folders are listed by hand: a new folder under shard/ must be added."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "shard").rglob("__init__.py")}
    assert set(tool["packages"]) == folders | {"shard.models", "shard.meshes"}
    assert tool["package-dir"] == {"shard.models": "models", "shard.meshes": "meshes"}
    assert tool["package-data"] == {"shard.meshes": ["*.yaml"], "shard.plan": ["*.yaml"]}  # presets; chips.yaml
