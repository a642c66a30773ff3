#!/usr/bin/env bash
# The whole check, as `make test` runs it (the venv must exist with requirements-dev.txt: make creates it):
#   1. ruff check .
#   2. lint-imports (import direction, pyproject.toml [tool.importlinter]) and mypy (pyproject.toml
#      [tool.mypy]: the project's packages, with the django-stubs and DRF stubs plugins)
#   3. pytest over the whole suite on PostgreSQL and Redis
#        DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test; pytest-django creates and
#        drops test_<name>[_gwN]) and REDIS_URL (default redis://127.0.0.1:6379), always on the
#        Redis database HORDE_TEST_REDIS_DB (default 15), which the suite flushes between tests
#   4. pytest on the embedded default (SQLite, no Redis) over the tests that apply there:
#        -m "not postgres_only and not redis_only"
# Arguments are passed to both pytest runs. PYTEST_WORKERS sets pytest-xdist's -n (default: twice the
# CPUs, from 2 to 8: most tests wait on the processes and sockets they start, so two per CPU keep the
# CPUs busy; on 2 CPUs 4 workers took a pass from 13.9 to 8.3 minutes); 0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
PY="$VENV/bin/python"

step() { printf '\n==> %s\n' "$*"; }

# pytest exits 5 when it ran no test (an empty suite, or every test deselected): not a failure here.
run_pytest() {
    local rc=0
    "$PY" -m pytest -p tests.xdist_env "${XDIST[@]}" "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "(no tests selected in this pass)"
        return 0
    fi
    return "$rc"
}

cpus=$(nproc 2>/dev/null || echo 1)
default_workers=$((2 * cpus))
((default_workers > 8)) && default_workers=8
((default_workers < 2)) && default_workers=2
workers=${PYTEST_WORKERS:-$default_workers}
XDIST=()
if [ "$workers" != "0" ]; then
    XDIST=(-n "$workers")
fi

step "ruff check ."
ruff check .

step "lint-imports"
lint-imports

step "mypy"
mypy

pg_url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
redis_base=${REDIS_URL:-redis://127.0.0.1:6379}
# Strip a database number from the URL, then use the dedicated test database.
redis_base=$(sed -E 's#(redis[s]?://[^/?]*)(/[0-9]*)?#\1#' <<<"$redis_base")
redis_url="$redis_base/${HORDE_TEST_REDIS_DB:-15}"
case "$redis_base" in *\?*) redis_url="${redis_base%%\?*}/${HORDE_TEST_REDIS_DB:-15}?${redis_base#*\?}";; esac

# The test database names (test_<name>_gwN) and Redis databases are fixed: two runs at once on one
# machine would drop each other's databases. Runs on one machine take turns.
lock=${TMPDIR:-/tmp}/hordesite-make-test.lock
exec 9>"$lock"
if ! flock -n 9; then
    echo "another make test is running on this machine: waiting for it (up to 15 minutes)"
    flock -w 900 9 || { echo "gave up waiting for $lock" >&2; exit 1; }
fi

step "pytest on PostgreSQL and Redis (DATABASE_URL=$pg_url REDIS_URL=$redis_url)"
DATABASE_URL="$pg_url" REDIS_URL="$redis_url" CELERY_BROKER_URL="" run_pytest "$@"

mkdir -p var/celery-broker var/celery-processed
step "pytest on the embedded default (SQLite, no Redis), without postgres_only and redis_only tests"
DATABASE_URL="sqlite:///$PWD/var/test-embedded.sqlite3" REDIS_URL="" CELERY_BROKER_URL="" \
    run_pytest -m "not postgres_only and not redis_only" "$@"
