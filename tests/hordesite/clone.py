"""A copy of the project as a fresh clone has it (no var/, no .env, no virtualenv), for tests of
what a process does when it starts in one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv", "var", ".env", "__pycache__", "*.pyc", "media")


def clone_like_copy(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=_NOT_IN_A_CLONE, symlinks=True)
    assert not (dest / "var").exists()
    return dest


def clean_env(**values: str) -> dict[str, str]:
    """This environment without the project's variables the test does not give (values: set)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("HORDE_", "CELERY_", "DJANGO_"))
        and name not in ("DATABASE_URL", "REDIS_URL", "DEBUG", "SECRET_KEY", "ALLOWED_HOSTS")
    }
    env.update(values, PYTHONUNBUFFERED="1")
    return env


def run_python(clone: Path, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=clone, env=env, capture_output=True, text=True, timeout=timeout
    )
