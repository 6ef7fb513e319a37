"""The README's shell commands, as a new user runs them one after another on a fresh clone.

Every `python train.py ...` and `python -m shard.launch ...` line in its ``` blocks is checked in this
process: its config loads, the launcher's dry run prints it, each job has a folder of its own (the one
its comment names, if any) and the same job always the same folder. The commands that could collide
(the default job, then another model on the same config, then the default job again on another mesh,
which must resume it) really train, shortened to one step, in a scratch working directory, and so does
the README's own model class (`model.name=mypkg.nets:MyNet`). Training the others as well would cost
minutes of the suite for no more collisions to find; the launcher starting real processes is
test_multihost.py's.
"""

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from shard import config
from shard.run import launch

README = ROOT / "README.md"
TRAIN = ["python", "train.py"]
LAUNCH = ["python", "-m", "shard.launch"]
# Keys that keep a job in its folder (the README says so): enough to make a run tiny, changing no folder.
SHORT = ["train.steps=1", "train.sample_len=0", "train.eval_batches=1", "run.progress=false", "run.cpu_devices=1"]
# What a job trains, as the README's "Each job has a folder of its own" paragraph lists it: its sections, the
# keys it excepts from them, and the single keys from other sections.
_FOLDER = re.search(r"changes what is trained: (.*?)\(each key says so", README.read_text(), flags=re.S).group(1)
JOB_SECTIONS = tuple(re.findall(r"`(\w+)\.\*`", _FOLDER))
NOT_JOB = tuple(re.findall(r"\(except `([\w.]+)`\)", _FOLDER))
JOB_KEYS = tuple(k for k in re.findall(r"`(\w+\.\w+)`", _FOLDER) if k not in NOT_JOB)


class Command:
    """One README command: `kind` (train or launch), its arguments after the program, its line's comment."""

    def __init__(self, kind: str, argv: list[str], comment: str, line: str):
        self.kind, self.argv, self.comment, self.line = kind, argv, comment, line
        args = argv[argv.index("--") + 1:] if kind == "launch" else argv
        self.flags = [a for a in args if a.startswith("-") and "=" not in a]
        args = launch.without_train_py([a for a in args if a not in self.flags])
        self.path = ROOT / args[0] if args and "=" not in args[0] else None  # relative to the clone's root
        self.overrides = args[1:] if self.path else args

    def load(self, overrides: list[str] | None = None) -> config.Config:
        return config.load(self.path or ROOT / "configs" / "default.yaml",
                           self.overrides if overrides is None else overrides)

    def job(self) -> tuple:
        """What the README promises picks the folder: an explicit run.dir, else the config file and the
        overrides of what is trained."""
        explicit = [o for o in self.overrides if o.startswith("run.dir=")]
        if explicit:
            return ("run.dir", explicit[-1])
        trained = sorted(o for o in self.overrides if _trains(o.partition("=")[0]))
        return ((self.path or ROOT / "configs" / "default.yaml").resolve(), *trained)

    def __repr__(self) -> str:
        return self.line


def _trains(key: str) -> bool:
    return (key.split(".")[0] in JOB_SECTIONS and key not in NOT_JOB) or key in JOB_KEYS


def test_the_readme_lists_the_keys_that_pick_a_folder_as_the_schema_marks_them():
    assert JOB_SECTIONS == config.JOB_SECTIONS
    assert set(NOT_JOB) == config.NOT_JOB
    assert list(JOB_KEYS) == config.job_keys_outside_sections()


def readme_commands() -> list[Command]:
    """The train.py and launcher commands of the README's ``` blocks, in the order a reader meets them
    (`pip install -e . && python train.py` gives `python train.py`; the usage synopsis is skipped)."""
    out = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if "train.py" not in line and "shard.launch" not in line:  # code and output blocks too
                continue
            tokens = shlex.split(line, comments=True)
            comment = line.split(" # ", 1)[1].strip() if " # " in line else ""
            parts, part = [], []
            for token in [*tokens, "&&"]:
                if token in ("&&", ";"):
                    parts, part = parts + [part], []
                else:
                    part.append(token)
            for argv in parts:
                if any(a.startswith("[") for a in argv):  # python train.py [CONFIG.yaml] [key=value ...]
                    continue
                if argv[:2] == TRAIN:
                    out.append(Command("train", argv[2:], comment, line.strip()))
                elif argv[:3] == LAUNCH:
                    out.append(Command("launch", argv[3:], comment, line.strip()))
    return out


COMMANDS = readme_commands()
TRAINING = [c for c in COMMANDS if c.kind == "train"]


def test_the_readme_has_the_commands_this_test_relies_on():
    assert TRAINING[0].argv == []  # the quick start: the default job
    assert any("model.n_layers=8" in c.argv for c in TRAINING)
    assert {c.argv[0] for c in COMMANDS if c.kind == "launch"} == {"local", "tpu", "slurm", "gke"}
    assert len(COMMANDS) >= 12


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c.argv)[:60] or "(default job)")
def test_every_command_loads_and_lands_in_the_folder_its_comment_names(command, capsys, monkeypatch):
    cfg = command.load()
    assert cfg.run.dir == command.load().run.dir  # the same command, the same folder
    assert cfg.run.dir == command.load(command.overrides[::-1]).run.dir  # in any order
    named = re.findall(r"\bruns/[\w.-]+", command.comment)
    for folder in named:  # `runs/gpt_small/plan.json` names runs/gpt_small
        assert folder == cfg.run.dir or folder.startswith(cfg.run.dir + "/"), (command, cfg.run.dir)
    if command.kind == "launch":  # every target's dry run (gke only prints anyway): it runs what it was given
        monkeypatch.setattr(launch, "free_port", lambda: 12345)
        target, rest = command.argv[0], command.argv[1:]
        assert launch.main([target, *(["--dry-run"] if target != "gke" else []), *rest]) == 0
        assert shlex.join(command.overrides) in capsys.readouterr().out


def test_distinct_jobs_get_distinct_folders_and_the_same_job_the_same():
    folders = {c.line: c.load().run.dir for c in COMMANDS}
    for a in COMMANDS:
        for b in COMMANDS:
            same_job, same_folder = a.job() == b.job(), folders[a.line] == folders[b.line]
            assert same_job == same_folder, f"{a!r} -> {folders[a.line]}, {b!r} -> {folders[b.line]}"
    assert folders[TRAINING[0].line] == "runs/default"


def train_main(*argv) -> int:
    """train.py's main() in this process (the interpreter and its compile cache are warm already)."""
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))


def test_the_jobs_that_could_collide_train_one_after_another(tmp_path, monkeypatch, capsys):
    """On a fresh clone, in order: the default job, a deeper bf16 model on the same config (its own
    folder: no 'use a new run.dir' error), then the default job on another mesh, which resumes it."""
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


def test_the_own_model_command_trains_the_readme_class(tmp_path, monkeypatch, capsys):
    """`model.name=mypkg.nets:MyNet ...`: the class the README shows, saved where it says, trains."""
    text = README.read_text()
    code = re.search(r"^```python\n(.*?)^```", text[text.index("## Writing a model"):], flags=re.S | re.M).group(1)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "nets.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the trainer imports the user's module from the cwd
    command = next(c for c in TRAINING if any(a.startswith("model.name=mypkg.") for a in c.argv))
    try:
        assert train_main(*SHORT, *command.overrides) == 0
    finally:
        for module in ("mypkg.nets", "mypkg"):
            sys.modules.pop(module, None)
    assert f"run folder: {tmp_path / command.load().run.dir}" in capsys.readouterr().out
