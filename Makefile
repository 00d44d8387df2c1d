# The two set-up commands (README): `make demo` and `make test`. Both create .venv as needed.
.PHONY: demo test test-slow lint venv services

venv:
	@scripts/bootstrap.sh

demo: venv
	.venv/bin/ciuic demo

lint: venv
	.venv/bin/ruff check src tests bench scripts
	.venv/bin/mypy

services:
	@scripts/services.sh

test: lint services
	.venv/bin/python -m pytest -q --durations=15

test-slow: venv
	.venv/bin/python -m pytest -q -m slow
