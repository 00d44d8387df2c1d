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

# MARK picks the tests (pyproject leaves out the slow ones): CI runs every test in one session,
# `make test MARK='not long'`, so that a module's services and reference runs start once.
# ARGS: more of pytest's options (CI: --slow-budget-min, tests/budget.py)
test: lint services
	.venv/bin/python -m pytest -q --durations=15 $(if $(MARK),-m "$(MARK)") $(ARGS)

test-slow: venv
	.venv/bin/python -m pytest -q -m slow --durations=15
