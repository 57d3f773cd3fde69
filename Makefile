# The two set-up commands of the README.
PY ?= python3

.PHONY: demo test test-unit install install-dev

install:
	bash scripts/install.sh

install-dev:
	bash scripts/install.sh --dev

demo: install
	megatron-search demo

test: install-dev
	PYTHON=$(PY) bash scripts/fetch_vllm_contract.sh
	$(PY) -m pytest -q -p no:cacheprovider tests

# The unit tier only (tests not marked multiprocess, slurm or e2e; pytest.ini): a quick check while editing,
# under a minute on 2 cores. It does not reinstall: run `make install-dev` once first.
test-unit:
	$(PY) -m pytest -q -p no:cacheprovider -m "not (multiprocess or slurm or e2e)" tests
