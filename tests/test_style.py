"""The project's Python files keep their lines to 120 characters: ruff's E501 at --line-length 120, counted
in characters (ruff counts a wide character twice and passes a line whose excess is a `# noqa` comment)."""

import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

MAX_LINE = 120
# Where the Python files live, for a copy of the repository without git.
FOLDERS = ["shard", "models", "meshes", "bench", "tests"]


def python_files() -> list[Path]:
    """Every tracked .py file and every new one git does not ignore; without git (not installed, or a copy
    that is not a checkout), those of FOLDERS and train.py."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
                                cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        walked = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
        if not walked:
            pytest.skip("git cannot list the repository's files and its folders are not here")
        return sorted([ROOT / "train.py", *walked])  # the test leaves out a file that is not there
    return sorted({ROOT / name for name in listed.stdout.split("\0") if name})


def test_no_line_over_120_characters():
    files = [path for path in python_files() if path.is_file()]  # a deleted file git still tracks is skipped
    assert files, "found no Python files"
    long = [f"{path.relative_to(ROOT)}:{number}: {len(line)} characters"
            for path in files
            for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1)
            if len(line) > MAX_LINE]
    assert not long, f"{len(long)} lines over {MAX_LINE} characters:\n" + "\n".join(long)
