"""docs/configuration.md names every environment variable the project reads, and every variable its
tables list is read somewhere: the settings of the horde and the front, the launcher, the reference
worker, `make` and scripts/test.sh (the suite's own, in tests/, for the rows that name them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from workers.bridge.config import _ENV as BRIDGE_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"

# Where the project's programs read their environment.
READERS = [
    "hordesite/settings.py",
    "oai/settings.py",
    "oai/django_settings.py",
    "scripts/run.py",
    "workers/bridge/config.py",
    "workers/bridge/connections.py",
]
# The readers' names for the environment: django-environ's Env (`env`, the front's `read`) and os.
ENVIRONMENT_OBJECTS = {"env", "read", "os.environ", "os", "environ"}
READ_METHODS = {"str", "bool", "int", "float", "list", "tuple", "dict", "json", "url", "db", "get", "getenv"}
# The platform's own, not the project's settings.
NOT_SETTINGS = {"TMPDIR"}
NAME = re.compile(r"[A-Z][A-Z0-9_]+")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def python_reads(path: Path) -> set[str]:
    """Names read from the environment by `env.int("NAME", ...)`, `os.environ.get("NAME")`,
    `os.environ["NAME"]`, including names held in module constants and looped over
    (`for name in (A, B): env.get(name)`)."""
    tree = ast.parse(path.read_text())
    bound: dict[str, set[str]] = {}

    def names(node: ast.AST) -> set[str] | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            out: set[str] = set()
            for element in node.elts:
                found = names(element)
                if found is None:
                    return None
                out |= found
            return out
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, (ast.comprehension, ast.For)):
            target, value = node.target, node.iter
        else:
            continue
        found = names(value)
        if isinstance(target, ast.Name) and found is not None:
            bound.setdefault(target.id, set()).update(found)
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if _dotted(node.func.value) in ENVIRONMENT_OBJECTS and node.func.attr in READ_METHODS:
                read |= names(node.args[0]) or set()
        elif isinstance(node, ast.Subscript) and _dotted(node.value) == "os.environ":
            read |= names(node.slice) or set()
    return {name for name in read if NAME.fullmatch(name)}


def make_reads() -> set[str]:
    """The Makefile's variables a caller may set: `NAME ?= ...` and `$(NAME)` not defined inside."""
    text = (ROOT / "Makefile").read_text()
    defined = set(re.findall(r"^([A-Z][A-Z0-9_]*) :=", text, re.M))
    return (set(re.findall(r"^([A-Z][A-Z0-9_]*) \?=", text, re.M)) | set(re.findall(r"\$\(([A-Z][A-Z0-9_]*)\)", text))) - defined


def shell_reads() -> set[str]:
    """scripts/test.sh's variables with a default: `${NAME:-default}`."""
    return set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):-", (ROOT / "scripts" / "test.sh").read_text()))


def project_reads() -> set[str]:
    read = {name for path in READERS for name in python_reads(ROOT / path)}
    read |= {variable for variable, _convert in BRIDGE_VARIABLES.values()}
    return (read | make_reads() | shell_reads()) - NOT_SETTINGS


def documented_rows() -> set[str]:
    """The names in the first cell of each table row."""
    rows: set[str] = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            rows |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return rows


def documented_anywhere() -> set[str]:
    return set(re.findall(r"`([A-Z][A-Z0-9_]+)`", DOC.read_text()))


def test_every_variable_the_project_reads_is_documented():
    assert project_reads() - documented_anywhere() == set()


def test_every_documented_variable_is_read():
    tests_read = {name for path in (ROOT / "tests").rglob("*.py") for name in python_reads(path)}
    assert documented_rows() - project_reads() - tests_read == set()


def test_the_scan_sees_each_kind_of_read():
    """The scan is not vacuous: each way of reading the environment above is found."""
    read = project_reads()
    assert {
        "DATABASE_URL",  # env.str in the settings
        "HORDE_OAI_MAX_INFLIGHT",  # the front's reader
        "HORDE_TELEMETRY_ENABLED",  # a module constant looped over
        "HORDE_DEMO_WORKER_KEY_FILE",  # os.environ.get in the launcher
        "BRIDGE_THREADS",  # the reference worker's table
        "SSL_CERT_FILE",  # os.environ.get in the worker
        "ARGS",  # make
        "PYTEST_WORKERS",  # scripts/test.sh
    } <= read
