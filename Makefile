# Two commands on a fresh machine: `make run` and `make test` (README.md).
# Both create .venv when it is missing. `make run` installs what the server runs (requirements.txt),
# `make test` that plus the tests' and tools' requirements (requirements-dev.txt); each (re)installs
# only when its files changed.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp
DEV_STAMP := $(VENV)/.requirements-dev.stamp
PORT ?= 8000

.PHONY: run test venv venv-dev lint bench drill var

# Serve the web process (daphne), the Celery worker with beat and the demo worker; Ctrl-C stops them.
run: venv var
	$(PY) manage.py migrate --noinput
	PORT=$(PORT) $(PY) scripts/run.py

# ruff, import-linter, mypy, then pytest on PostgreSQL + Redis and on the embedded default (scripts/test.sh).
# Extra pytest arguments: make test ARGS="-k status -x"
test: venv-dev
	VENV=$(VENV) bash scripts/test.sh $(ARGS)

venv: $(STAMP)

venv-dev: $(DEV_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	touch $(STAMP)

$(DEV_STAMP): requirements-dev.txt requirements.txt | $(PY)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	touch $(STAMP) $(DEV_STAMP)

# The embedded default's local state (the processes also create what they need when they start).
var:
	mkdir -p var

lint: venv-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The queue benchmark (docs/benchmarks.md): needs PostgreSQL and Redis; its database is recreated.
# Options: make bench ARGS="--requests 10000 --models 50 --workers 100 --duration 90"
bench: venv var
	$(PY) bench/text_queue.py $(ARGS)

# The fault drills (docs/reliability.md): each on a PostgreSQL cluster and a Redis server of its own
# (needs initdb/pg_ctl and redis-server); not part of `make test`. About 6-9 minutes;
# make drill ARGS=--short (shorter faults), ARGS="--only redis,postgres".
drill: venv-dev
	$(PY) -m drills $(ARGS)
