# DSTL — every target that needs Python creates .venv from pyproject.toml when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: azurite demo test test-fast test-deep bench bench-quick lint typecheck clean venv

venv: $(STAMP)

# s3fs goes in first: resolved together with boto3/moto, pip can fall back to a 2020-era s3fs.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "s3fs>=2024.6.0"
	$(PY) -m pip install --quiet -e ".[spark,hdfs,dev]"
	$(MAKE) --no-print-directory azurite || echo "WARNING: Azurite not installed: the Azure store tests will fail until 'make azurite' succeeds"
	touch $(STAMP)

# Azurite (Microsoft's Azure Storage emulator, from the npm registry) for the store contract
# suite's Azure run; pinned, installed under .venv so `make clean` removes it.
AZURITE_VERSION := 3.37.0
AZURITE := $(VENV)/node/node_modules/.bin/azurite-blob
azurite: $(AZURITE)
$(AZURITE):
	@command -v npm >/dev/null || { echo "npm not found: Node.js and npm are needed for the Azure (Azurite) store tests"; exit 1; }
	npm install --silent --no-audit --no-fund --prefix $(VENV)/node azurite@$(AZURITE_VERSION)

demo: $(STAMP)
	$(PY) -m dstl demo

# Everything CI runs. Heavier runs: `make test-deep` (DSTL_DEEP=1).
# --dist loadfile: each test module runs on one worker, so its module-scoped Spark session, local
# cluster and emulators start once. (--dist loadgroup no longer groups with pytest >= 9.2 and
# pytest-xdist 3.8: xdist's "@group" node-id suffix is lost, pytest-dev/pytest-xdist#1386, and
# every module ran on both workers, each starting its own fixtures. The xdist_group marks stay:
# they name the tests that share a resource.)
XDIST := -n 2 --dist loadfile
test: $(STAMP)
	$(PY) -m pytest $(XDIST) -q

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/contract -m "not s3 and not spark and not hdfs"

test-deep: $(STAMP)
	DSTL_DEEP=1 HYPOTHESIS_PROFILE=deep $(PY) -m pytest $(XDIST) -q

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

bench-quick: $(STAMP)
	for b in bench/*.py; do $(PY) $$b --quick || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check dstl materializer restore tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
