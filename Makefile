# Conduit: `make run` serves the stack, `make test` runs every check (`make test-fast`: the unit layer).
# All set up .venv themselves.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
GEN := protos/python/gen
GEN_STAMP := $(GEN)/.generated
PROTO := protos/conduit/engine/v1/engine.proto
MODEL ?=
ENGINE_PORT ?= 50051
GATEWAY_PORT ?= 8000
PYTEST_ARGS ?=
# Parallel pytest workers for make test (pytest-xdist, a file per worker at a time): one per core here.
TEST_WORKERS ?= 2

.PHONY: venv proto redis-server test test-fast lint format run run-engine demo-model bench bench-setup bench-peers compose-up clean

venv: $(STAMP) $(GEN_STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt services/common/pyproject.toml services/engine/pyproject.toml services/gateway/pyproject.toml protos/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the pinned CPU wheel, so that nothing later resolves a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(MAKE) --no-print-directory proto PY=$(PY)
	$(PY) -m pip install -q --no-deps -e protos/python -e services/common -e services/engine -e services/gateway
	# The CPU kernels (kernels/cpu, about a minute); without a compiler it says so and the torch ops run.
	$(PY) -m conduit_engine.ops.cpu_kernels
	touch $@

proto: $(GEN_STAMP)

$(GEN_STAMP): $(PROTO)
	rm -rf $(GEN) && mkdir -p $(GEN)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$(GEN) --grpc_python_out=$(GEN) --pyi_out=$(GEN) $(PROTO)
	touch $@

# The Responses store tests start their own redis-server (Debian's package, installed when missing).
redis-server:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)

# Every layer (unit, integration, deploy, kernels); CI runs this (.ci/run).
test: venv redis-server
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The unit layer only: in-process tests, no servers or long-lived child processes (under a minute).
test-fast: venv
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo-model: venv
	$(PY) -m conduit_engine.models.demo_model .models/demo-llama

# Serve MODEL (a folder or a Hub id org/name) with the engine and the gateway. Without MODEL:
# HuggingFaceTB/SmolLM2-135M-Instruct from the Hub, or offline the random demo model (it says why).
run: venv
	$(PY) -m conduit_engine.entrypoints.run_stack $(if $(MODEL),--model "$(MODEL)") --demo-dir .models/demo-llama \
		--engine-port $(ENGINE_PORT) --gateway-port $(GATEWAY_PORT)

run-engine: venv
	@if [ -z "$(MODEL)" ]; then $(MAKE) --no-print-directory demo-model; fi
	$(VENV)/bin/conduit-engine --model "$(if $(MODEL),$(MODEL),.models/demo-llama)" --port $(ENGINE_PORT)

bench: venv
	$(PY) bench/engine_throughput.py

# The benchmark-only tools (matplotlib, tqdm, py-spy) for bench/serving.py, bench/plot.py, bench/peers.py.
bench-setup: venv
	$(PY) -m pip install -q -r bench/requirements.txt
	@# bench/gateway_workers.py --client wrk: Debian's wrk, installed when missing.
	@command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk)

# Conduit beside llama.cpp's llama-server and vLLM CPU on the same weights (builds the peers once, ~15 min).
PEERS_ARGS ?=
bench-peers: bench-setup
	$(PY) bench/peers.py $(PEERS_ARGS)

# Engine profile of docker-compose.yml: cpu (default) or gpu. Needs a machine with Docker.
COMPOSE_PROFILE ?= cpu
compose-up:
	@if [ -z "$(MODEL)" ]; then $(MAKE) --no-print-directory demo-model; fi
	CONDUIT_MODEL_DIR="$(if $(MODEL),$(MODEL),.models/demo-llama)" docker compose --profile $(COMPOSE_PROFILE) up --build

clean:
	rm -rf $(VENV) $(GEN) .models
