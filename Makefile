# Two commands for a newcomer: `make demo` (everything, end to end) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
export HTTP_PORT GRPC_PORT METRICS_PORT

.PHONY: setup engines serve demo test test-unit bench genai-perf bundle clean

setup:            ## venv + pinned stack + tritonserver + perf_analyzer (idempotent)
	bash scripts/setup.sh

engines: setup    ## tiny default engines + the trained SmolLM2 (smollm2) into model_repository/ (skips what is up to date)
	$(PY) -m build_engines all --tiny
	$(PY) -m build_engines llm --pretrained smollm2 --name smollm2

serve: engines    ## foreground tritonserver on HTTP_PORT/GRPC_PORT/METRICS_PORT
	$(PY) -m backends.server --repository model_repository

demo: engines     ## start the server, call every model once, stop it
	$(PY) -m client.demo

test: engines     ## the whole suite: unit tests and integration tests against a real tritonserver
	$(PY) -m pytest -q tests

test-unit: setup
	$(PY) -m pytest -q tests/unit

bench: engines genai-perf  ## perf scenarios (perf/) and the in-process LLM engine benchmark
	$(PY) -m perf
	$(PY) -m perf.llm_engine
	$(PY) -m perf.whisper_bench
	$(PY) -m perf.sam_bench --concurrency 1 4

bundle: setup     ## dist/*.tar.xz for an offline GPU host (BUNDLE_PYTHON=3.12); perf/gpu_bench.sh runs it there
	bash scripts/bundle.sh

genai-perf:       ## genai-perf in its own venv: make bench compares its LLM figures with ours
	test -x .venv-genai-perf/bin/genai-perf || \
	  (python3 -m venv .venv-genai-perf && .venv-genai-perf/bin/pip install -q genai-perf==0.0.8)

clean:
	rm -rf logs .pytest_cache model_repository/*/[0-9]* model_repository/*/warmup model_repository/*/labels.txt
