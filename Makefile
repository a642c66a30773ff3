# Two commands on a fresh machine: `make run` and `make test` (README.md).
# Both create .venv when it is missing and (re)install requirements.txt only when it changed.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp
PORT ?= 8000

.PHONY: run test venv lint bench var

# Serve the web process (daphne) and the Celery worker with beat; Ctrl-C stops both.
run: venv var
	$(PY) manage.py migrate --noinput
	PORT=$(PORT) $(PY) scripts/run.py

# ruff, import-linter, then pytest on PostgreSQL + Redis and on the embedded default (scripts/test.sh).
# Extra pytest arguments: make test ARGS="-k status -x"
test: venv
	VENV=$(VENV) bash scripts/test.sh $(ARGS)

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	touch $(STAMP)

var:
	mkdir -p var/celery-broker var/celery-processed var/media

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The queue benchmark (docs/benchmarks.md): needs PostgreSQL and Redis; its database is recreated.
# Options: make bench ARGS="--requests 10000 --models 50 --workers 100 --duration 90"
bench: venv var
	$(PY) bench/text_queue.py $(ARGS)
