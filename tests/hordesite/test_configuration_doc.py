"""docs/configuration.md names every environment variable the project reads, and every variable its
tables list is read somewhere: the settings of the horde and the front, the launcher, the reference
worker, `make` and scripts/test.sh (the suite's own, in tests/, for the rows that name them)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import re
from pathlib import Path

from workers.bridge.config import _ENV as BRIDGE_VARIABLES
from workers.bridge.config import BridgeConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"

# Where the project's programs read their environment.
READERS = [
    "contract/env.py",  # the reader's class; it names no variable
    "hordesite/settings.py",
    "oai/settings.py",
    "oai/django_settings.py",
    "scripts/run.py",
    "workers/bridge/config.py",
    "workers/bridge/connections.py",
]
# Where the project's own code lives (the benches and drills document their variables apart).
PROJECT_CODE = ["hordesite", "oai", "chat", "accounts", "workers", "contract", "scripts", "manage.py"]
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


def reads_environment(path: Path) -> bool:
    """Whether a module reads the environment: `os.environ`, `os.getenv` or django-environ's `Env`
    (or the project's SettingsEnv over it) anywhere but `os.environ.setdefault("DJANGO_SETTINGS_MODULE", ...)`, which only names the
    settings module."""
    tree = ast.parse(path.read_text())
    naming_the_settings: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and _dotted(node.func) == "os.environ.setdefault"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "DJANGO_SETTINGS_MODULE"
        ):
            naming_the_settings.add(id(node.func.value))  # type: ignore[attr-defined]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and {"environ", "getenv"} & {a.name for a in node.names}:
            return True
        if _dotted(node) in ("os.environ", "os.getenv", "environ.Env", "SettingsEnv") and id(node) not in naming_the_settings:
            return True
    return False


def test_every_module_that_reads_the_environment_is_scanned():
    """READERS is the whole list: a module that starts reading the environment must join it, or its
    variables would escape the tests above (and each listed reader is seen reading)."""
    modules = set()
    for entry in PROJECT_CODE:
        paths = [ROOT / entry] if entry.endswith(".py") else (ROOT / entry).rglob("*.py")
        modules |= {str(path.relative_to(ROOT)) for path in paths if reads_environment(path)}
    assert modules == set(READERS)


def _documented_default_values() -> dict[str, set[str]]:
    """The backticked values in each variable's default cell (every row that names it)."""
    values: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            cells = line.split("|")
            for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[1]):
                values.setdefault(name, set()).update(re.findall(r"`([^`]+)`", cells[2]))
    return values


def _literal_defaults(path: Path) -> dict[str, object]:
    """`env.int("NAME", default=...)` defaults that are values: a literal, a list of literals, or a
    constant imported from `contract`. A computed default (an expression, a fallback to another
    variable, an empty value standing for "unset") is the row's prose to state, not checked here."""
    tree = ast.parse(path.read_text())
    from_contract = {
        alias.asname or alias.name: node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("contract")
        for alias in node.names
    }

    def value(node: ast.AST) -> object:
        if isinstance(node, ast.Constant) and node.value not in ("", None):
            return node.value
        if isinstance(node, ast.List) and node.elts and all(isinstance(e, ast.Constant) for e in node.elts):
            return [e.value for e in node.elts]  # type: ignore[attr-defined]
        if isinstance(node, ast.Name) and node.id in from_contract:
            return getattr(importlib.import_module(from_contract[node.id]), node.id)
        return None

    defaults: dict[str, object] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _dotted(node.func.value) in ENVIRONMENT_OBJECTS
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            for keyword in node.keywords:
                if keyword.arg == "default" and (found := value(keyword.value)) is not None:
                    defaults[node.args[0].value] = found
    return defaults


def _bridge_defaults() -> dict[str, object]:
    """The reference worker's defaults, by variable: its config's own field defaults."""
    fields = {field.name: field.default for field in dataclasses.fields(BridgeConfig)}
    return {
        variable: fields[attr]
        for attr, (variable, _convert) in BRIDGE_VARIABLES.items()
        if fields.get(attr, dataclasses.MISSING) not in (dataclasses.MISSING, None, "")
    }


def _shown(default: object, documented: set[str], *, booleans: tuple[str, str]) -> bool:
    if isinstance(default, bool):
        return booleans[default] in documented
    if isinstance(default, (int, float)):
        numbers = set()
        for value in documented:
            with contextlib.suppress(ValueError):  # the cell's words and names
                numbers.add(float(value))
        return float(default) in numbers
    if isinstance(default, list):
        return ",".join(default) in documented
    return str(default) in documented


def test_every_literal_default_is_the_documented_one():
    documented = _documented_default_values()
    wrong = {}
    for path in ("hordesite/settings.py", "oai/settings.py", "oai/django_settings.py"):
        for name, default in _literal_defaults(ROOT / path).items():
            if not _shown(default, documented.get(name, set()), booleans=("false", "true")):
                wrong[name] = (default, documented.get(name))
    for name, default in _bridge_defaults().items():
        if not _shown(default, documented.get(name, set()), booleans=("0", "1")):
            wrong[name] = (default, documented.get(name))
    assert wrong == {}


def test_the_default_scan_sees_each_kind_of_default():
    """The defaults test is not vacuous: each kind of default above is compared."""
    settings = _literal_defaults(ROOT / "hordesite" / "settings.py")
    front = _literal_defaults(ROOT / "oai" / "settings.py")
    assert settings["HORDE_WEB_THREADS"] == 4  # a literal
    assert settings["HORDE_TEXT_ASYNC_RATE_LIMITS"] == ["2/second", "90/minute"]  # a list
    assert settings["HORDE_TEXT_JOB_LEASE_SECONDS"] == 150  # a contract constant
    assert front["HORDE_OAI_STREAM_REDIS_DB"] == 7 and front["HORDE_OAI_RELAY_WITH_TOOLS"] is False
    assert _bridge_defaults()["BRIDGE_PROGRESS_INTERVAL"] == 0.25
    assert not _shown(5.0, {"10"}, booleans=("false", "true")) and not _shown(True, {"false"}, booleans=("false", "true"))


def _integer_durations(path: Path) -> set[str]:
    """Durations (`..._SECONDS`, `..._TIMEOUT`) read as integers: `env.int("NAME")`."""
    return {
        node.args[0].value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "int"
        and _dotted(node.func.value) in ENVIRONMENT_OBJECTS
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and re.search(r"_(SECONDS|TIMEOUT)$", node.args[0].value)
    }


def test_the_whole_second_durations_are_the_ones_read_as_integers():
    """The doc says which durations take whole seconds: a `1.5` there stops the process."""
    sentence = re.search(r"which take whole seconds[^:]*:(.*?)\.\n", DOC.read_text(), re.S)
    assert sentence is not None
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", sentence.group(1)))
    read = _integer_durations(ROOT / "hordesite" / "settings.py") | _integer_durations(ROOT / "oai" / "settings.py")
    assert "HORDE_TEXT_JOB_LEASE_SECONDS" in read
    assert documented == read
