"""Every shell command in README.md and docs/*.md, as a reader would type it, is checked here.

Each ```bash block's lines are split into commands (`&&`, `;`, backslash continuations), and each
command must be one this file knows how to check:

- `python train.py ...`: its config loads (every key and value validated) and its model resolves with
  its arguments checked against the class; each job has a folder of its own (the one its comment
  names, if any) and the same job always the same folder. `--help` and `--print-config` run in this
  process. The commands that could collide (the default job, a deeper model on the same config, the
  default job again on another mesh, which must resume it) train one step each in a scratch folder, and
  so does the model class writing-a-model.md shows; the README's `--dry-run` runs as a real process.
  Training every command would cost minutes of the suite and find no more.
- `python -m shard.launch ...` / `shard-launch ...`: each target's own dry run (tpu needs gcloud and
  slurm sbatch; both only print here, and gke only prints anyway).
- `python -m shard.generate|export|plot|serve ...`: the module exists and its argument parser takes the
  arguments; key=value overrides load as a config. They need a trained run (and export jax2onnx), so
  they are parsed, not run, except the README's shard.plot and shard.generate, which use the scratch
  runs above.
- `pip install -e ...`: the extras it names exist in pyproject.toml; `python -m pytest ...`: the quick
  start, which .ci/run runs verbatim; `python bench/X.py`: the script exists (each takes minutes);
  `tensorboard ...`: not a dependency, not run.

The ```python blocks run too: writing-a-model.md's class trains (above), and trained-model.md's
`shard.load_model` lines load the scratch default job. Beyond code: the list of keys that pick a run
folder (docs/runs.md) is the schema's, every path the pages name exists, and every link between the
pages reaches a file and a heading.
"""

import argparse
import importlib
import importlib.util
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from shard import config
from shard.core import registry
from shard.run import launch

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = PAGES[0]
QUICK_START = ["pip install -e . && python train.py", 'pip install -e ".[test]" && python -m pytest -q -n 2']
TRAIN = ["python", "train.py"]
# Keys that keep a job in its folder (docs/runs.md says so): enough to make a run tiny, changing no folder.
SHORT = ["train.steps=1", "train.sample_len=0", "train.eval_batches=1", "run.progress=false", "run.cpu_devices=1"]


def text(page: Path) -> str:
    return page.read_text()


# What a job trains, as docs/runs.md's run-folder paragraph lists it: its sections, the keys it excepts
# from them, and the single keys from other sections.
_FOLDER = re.search(r"changes what is trained: (.*?)\(each key says so", text(ROOT / "docs" / "runs.md"),
                    flags=re.S).group(1)
JOB_SECTIONS = tuple(re.findall(r"`(\w+)\.\*`", _FOLDER))
NOT_JOB = tuple(k for part in re.findall(r"\(except (.*?)\)", _FOLDER) for k in re.findall(r"`([\w.]+)`", part))
JOB_KEYS = tuple(k for k in re.findall(r"`(\w+\.[\w.]*\w)`", _FOLDER) if k not in NOT_JOB)


def _trains(key: str) -> bool:
    return (key.split(".")[0] in JOB_SECTIONS and key not in NOT_JOB) or key in JOB_KEYS


class Command:
    """One command of a page's ```bash blocks: `kind`, its arguments after the program, its line's comment."""

    def __init__(self, kind: str, argv: list[str], comment: str, line: str, page: Path):
        self.kind, self.argv, self.comment, self.line, self.page = kind, argv, comment, line, page
        args = argv[argv.index("--") + 1:] if kind == "launch" else argv
        self.flags = [a for a in args if a.startswith("-") and "=" not in a]
        args = launch.without_train_py([a for a in args if a not in self.flags])
        self.path = ROOT / args[0] if kind in ("train", "launch") and args and "=" not in args[0] else None
        self.overrides = args[1:] if self.path else args

    def load(self, overrides: list[str] | None = None) -> config.Config:
        return config.load(self.path or ROOT / "configs" / "default.yaml",
                           self.overrides if overrides is None else overrides)

    def job(self) -> tuple:
        """What runs.md promises picks the folder: an explicit run.dir, else the config file and the
        overrides of what is trained."""
        explicit = [o for o in self.overrides if o.startswith("run.dir=")]
        if explicit:
            return ("run.dir", explicit[-1])
        trained = sorted(o for o in self.overrides if _trains(o.partition("=")[0]))
        return ((self.path or ROOT / "configs" / "default.yaml").resolve(), *trained)

    def __repr__(self) -> str:
        return f"{self.page.name}: {self.line}"


def kind_of(argv: list[str]) -> tuple[str, list[str]]:
    """(kind, the arguments after the program) of one command."""
    if argv[:2] == TRAIN:
        return "train", argv[2:]
    if argv[:3] == ["python", "-m", "shard.launch"] or argv[:1] == ["shard-launch"]:
        return "launch", argv[3:] if argv[0] == "python" else argv[1:]
    if argv[:2] == ["python", "-m"] and argv[2].startswith("shard."):
        return "module", argv[2:]
    if argv[:2] == ["python", "-m"] and argv[2] == "pytest":
        return "pytest", argv[3:]
    if argv[:3] == ["pip", "install", "-e"]:
        return "pip", argv[3:]
    if argv[0] == "python" and argv[1].startswith("bench/"):
        return "bench", argv[1:]
    if argv[0] == "tensorboard":
        return "tensorboard", argv[1:]
    raise AssertionError(f"{' '.join(argv)!r}: a command tests/test_docs.py does not know how to check; teach it")


def bash_blocks(page: Path) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text(page), flags=re.S | re.M)


def commands() -> list[Command]:
    """Every command of every page's ```bash blocks, README first, in the order a reader meets them
    (`pip install -e . && python train.py` gives two; a synopsis with [OPTIONAL] parts is skipped)."""
    out = []
    for page in PAGES:
        for block in bash_blocks(page):
            for line in block.replace("\\\n", " ").splitlines():
                tokens = shlex.split(line, comments=True)
                comment = line.split(" # ", 1)[1].strip() if " # " in line else ""
                parts, part = [], []
                for token in [*tokens, "&&"]:
                    if token in ("&&", ";"):
                        parts, part = parts + [part] if part else parts, []
                    else:
                        part.append(token)
                for argv in parts:
                    if any(a.startswith("[") for a in argv):  # python train.py [CONFIG.yaml] [key=value ...]
                        continue
                    kind, args = kind_of(argv)
                    out.append(Command(kind, args, comment, line.strip(), page))
    return out


COMMANDS = commands()
TRAINING = [c for c in COMMANDS if c.kind == "train"]
FOLDERS = [c for c in COMMANDS if c.kind in ("train", "launch")]


def of(kind: str) -> list[Command]:
    return [c for c in COMMANDS if c.kind == kind]


def ids(c: Command) -> str:
    return f"{c.page.stem}: {' '.join(c.argv)[:60]}" if c.argv else f"{c.page.stem}: (no arguments)"


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """writing-a-model.md's class, saved as `mypkg/nets.py` where it says, importable while the module runs."""
    page = text(ROOT / "docs" / "writing-a-model.md")
    code = re.search(r"^```python\n(.*?)^```", page, flags=re.S | re.M).group(1)
    folder = tmp_path_factory.mktemp("own_model")
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "nets.py").write_text(code)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    for module in ("mypkg.nets", "mypkg"):
        sys.modules.pop(module, None)


def _train_script():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN_SCRIPT = _train_script()


def train_main(*argv) -> int:
    """train.py's main() in this process (the interpreter and its compile cache are warm already)."""
    return TRAIN_SCRIPT.main(list(argv))


# ----------------------------------------------------------------------------- what the pages must hold

def test_the_readme_opens_with_the_quick_start_that_ci_runs():
    blocks = [b.strip() for b in bash_blocks(README)]
    assert blocks[:2] == QUICK_START
    assert QUICK_START[1] in (ROOT / ".ci" / "run").read_text().splitlines()
    assert TRAINING[0].argv == [] and TRAINING[0].page == README  # the default job


def test_the_pages_have_the_commands_this_test_relies_on():
    assert any("model.n_layers=8" in c.argv for c in TRAINING if c.page == README)
    assert any("--dry-run" in c.flags for c in TRAINING if c.page == README)
    assert {c.argv[0] for c in of("launch")} == {"local", "tpu", "slurm", "gke"}
    assert {c.argv[0] for c in of("module")} == {"shard.generate", "shard.export", "shard.plot", "shard.serve",
                                                 "shard.eval"}
    assert any(a.startswith("model.name=mypkg.") for c in TRAINING for a in c.argv)


def test_the_combination_table_is_the_strategies_own():
    from shard.strategies import registry as strategies

    page = (ROOT / "docs" / "meshes.md").read_text()
    shown = page.split("<!-- strategies: refused pairs -->\n", 1)[1].split("\n<!-- end -->", 1)[0]
    assert shown == strategies.table()


def test_the_runs_page_lists_the_keys_that_pick_a_folder_as_the_schema_marks_them():
    assert JOB_SECTIONS == config.JOB_SECTIONS
    assert set(NOT_JOB) == config.NOT_JOB
    assert list(JOB_KEYS) == config.job_keys_outside_sections()


def test_every_path_the_pages_name_exists():
    missing = []
    for page in PAGES:
        for path in re.findall(r"(?<![\w./])((?:shard|models|meshes|configs|bench|tests|docs)/[\w./-]*\w)", text(page)):
            if re.search(r"[A-Z]{3,}", path):  # a placeholder (configs/NAME.yaml)
                continue
            if not ((ROOT / path).exists() or (ROOT / f"{path}.py").exists()):
                missing.append(f"{page.name}: {path}")
    assert not missing


def test_every_config_key_the_pages_name_is_in_the_schema():
    """`train.remat`, `mesh.zero=1|2`, ... in the prose: the keys `python train.py --help` lists."""
    listed = set(re.findall(r"^\s+(\w+\.[\w.]+)\s", config.help_text(None, None, "defaults", None), flags=re.M))
    named = r"`((?:data|optimizer|train|mesh|pipeline|run|checkpoint)\.[a-z_.]*[a-z])(?![\w<])"  # not mesh.dcn_<axis>
    unknown = []
    for page in PAGES:
        for key in re.findall(named, text(page)):
            if key not in listed | {"train.py"} and not key.startswith("mesh.rules."):
                unknown.append(f"{page.name}: {key}")
    assert not unknown


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", text(page), flags=re.S | re.M), flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_every_link_between_the_pages_reaches_a_file_and_a_heading():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", text(page)):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                broken.append(f"{page.name}: {target}")
    assert not broken


# ----------------------------------------------------------------------------- train.py

@pytest.mark.parametrize("command", TRAINING, ids=ids)
def test_every_train_command_loads_resolves_and_lands_in_the_folder_its_comment_names(command, own_model):
    cfg = command.load()
    registry.load(cfg.model)  # the model exists and takes these arguments
    assert set(command.flags) <= set(TRAIN_SCRIPT.FLAGS), command
    assert cfg.run.dir == command.load().run.dir  # the same command, the same folder
    assert cfg.run.dir == command.load(command.overrides[::-1]).run.dir  # in any order
    for folder in re.findall(r"\bruns/[\w.-]+", command.comment):  # `runs/gpt_small/plan.json` names runs/gpt_small
        assert folder == cfg.run.dir or folder.startswith(cfg.run.dir + "/"), (command, cfg.run.dir)


def test_distinct_jobs_get_distinct_folders_and_the_same_job_the_same():
    folders = {c.line: c.load().run.dir for c in FOLDERS}
    for a in FOLDERS:
        for b in FOLDERS:
            same_job, same_folder = a.job() == b.job(), folders[a.line] == folders[b.line]
            assert same_job == same_folder, f"{a!r} -> {folders[a.line]}, {b!r} -> {folders[b.line]}"
    assert folders[TRAINING[0].line] == "runs/default"


@pytest.mark.parametrize("command", [c for c in TRAINING if set(c.flags) & {"--help", "--print-config"}], ids=ids)
def test_the_help_and_print_config_commands_run(command, own_model, capsys):
    path = [str(command.path)] if command.path else []
    assert train_main(*path, *command.overrides, *command.flags) == 0
    out = capsys.readouterr().out
    assert ("run.dir" in out) if "--help" in command.flags else (f"dir: {command.load().run.dir}" in out), out


def test_the_jobs_that_could_collide_train_one_after_another_then_plot_and_load(tmp_path, monkeypatch, capsys):
    """On a fresh clone, in order: the default job, a deeper bf16 model on the same config (its own
    folder: no 'use a new run.dir' error), then the default job on another mesh, which resumes it; then
    the README's `python -m shard.plot` draws the first two, its `python -m shard.generate` samples the
    first, and trained-model.md's Python loads it."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # a clone's configs/; runs/ lands in tmp_path
    monkeypatch.chdir(tmp_path)
    default = TRAINING[0]
    deeper = next(c for c in TRAINING if "model.n_layers=8" in c.argv)
    other_mesh = next(c for c in TRAINING if c.job() == default.job() and any(a.startswith("mesh") for a in c.argv)
                      and not c.flags)
    for command in (default, deeper, other_mesh):
        path = [str(command.path.relative_to(ROOT))] if command.path else []
        assert train_main(*path, *SHORT, *command.overrides) == 0, command
    out = capsys.readouterr().out
    folders = [Path(line.split(": ", 1)[1]).resolve() for line in out.splitlines() if line.startswith("run folder: ")]
    expected = [(tmp_path / c.load().run.dir).resolve() for c in (default, deeper, other_mesh)]
    assert folders == expected and folders[0] != folders[1] and folders[0] == folders[2], out
    assert "resuming from step 1" in out and "already past train.steps=1" in out, out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(f.name for f in folders[:2])

    for name in ("shard.plot", "shard.generate"):  # the README's: both runs' curves, then text from the first
        command = next(c for c in of("module") if c.argv[0] == name and c.page == README)
        assert importlib.import_module(name).main(command.argv[1:]) == 0, command
    assert (tmp_path / "compare.png").stat().st_size > 0

    # trained-model.md's load_model lines, on the default job just trained: one device, then split.
    page = text(ROOT / "docs" / "trained-model.md")
    namespace = {}
    exec(re.search(r"^```python\n(.*?)^```", page, flags=re.S | re.M).group(1), namespace)
    assert type(namespace["model"]).__name__ == "GPT"


def test_the_own_model_command_trains_the_class_the_page_shows(tmp_path, monkeypatch, own_model, capsys):
    """`model.name=mypkg.nets:MyNet ...`: the class writing-a-model.md shows, saved where it says, trains."""
    monkeypatch.chdir(tmp_path)
    command = next(c for c in TRAINING if any(a.startswith("model.name=mypkg.") for a in c.argv))
    assert train_main(*SHORT, *command.overrides) == 0
    assert f"run folder: {tmp_path / command.load().run.dir}" in capsys.readouterr().out


def test_the_readme_dry_run_runs_as_a_process(tmp_path):
    command = next(c for c in TRAINING if c.page == README and "--dry-run" in c.flags)
    path = [str(command.path)] if command.path else []
    done = run_cli(*path, *command.overrides, *command.flags, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / command.load().run.dir / "plan.json").is_file()
    assert "memory per device" in done.stdout and "collectives:" in done.stdout, done.stdout


# ----------------------------------------------------------------------------- other programs

@pytest.mark.parametrize("command", of("launch"), ids=ids)
def test_every_launcher_command_passes_its_dry_run(command, capsys, monkeypatch):
    monkeypatch.setattr(launch, "free_port", lambda: 12345)
    target, rest = command.argv[0], command.argv[1:]
    assert launch.main([target, *(["--dry-run"] if target != "gke" else []), *rest]) == 0
    assert shlex.join(command.overrides) in capsys.readouterr().out
    command.load()


class Parsed(Exception):
    """Raised where a module's parser has taken its arguments: (namespace, what it left over)."""


@pytest.mark.parametrize("command", of("module"), ids=ids)
def test_every_module_command_exists_and_its_parser_takes_the_arguments(command, monkeypatch):
    name, args = command.argv[0], command.argv[1:]
    assert importlib.util.find_spec(name), f"python -m {name}: no such module"
    module = importlib.import_module(name)
    parse = argparse.ArgumentParser.parse_known_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise Parsed(*parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop_after_parsing)
    with pytest.raises(Parsed) as parsed:
        module.main(args)
    taken, left = parsed.value.args
    left = [*getattr(taken, "overrides", []), *left]  # the loading commands declare key=value ... (shard/use/load.py)
    assert all("=" in a and not a.startswith("-") for a in left), (command, left)
    config.load(ROOT / "configs" / "default.yaml", left)  # the mesh and device overrides


def test_every_pip_install_names_extras_that_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for command in of("pip"):
        assert command.argv[0] == "." or re.fullmatch(r"\.\[(\w+)\]", command.argv[0]), command
        named = re.findall(r"\[(\w+)\]", command.argv[0])
        assert set(named) <= extras, command
    for page in PAGES:  # the extras the prose names too: `".[cuda]"`
        assert set(re.findall(r'"\.\[(\w+)\]"', text(page))) <= extras, page.name


def test_the_pytest_and_bench_commands_name_what_exists():
    assert [" ".join(c.argv) for c in of("pytest")] == ["-q -n 2"]
    for command in of("bench"):
        assert (ROOT / command.argv[0]).is_file(), command
