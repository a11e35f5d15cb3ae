# Two commands for a newcomer: `make demo` (everything, end to end) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
export HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT

.PHONY: setup engines serve openai demo test test-unit stress bench genai-perf fp8-reference bundle clean

setup:            ## venv + pinned stack + tritonserver + perf_analyzer (idempotent)
	bash scripts/setup.sh

engines: setup    ## tiny default engines + the trained SmolLM2 (smollm2, with its LoRA adapters) (skips what is up to date)
	$(PY) -m build_engines all --tiny
	$(PY) -m build_engines llm --pretrained smollm2 --name smollm2 --max-loras 4
	$(PY) -m build_engines.lora model_repository/smollm2/1/adapters

serve: engines    ## foreground tritonserver on HTTP_PORT/GRPC_PORT/METRICS_PORT
	$(PY) -m backends.server --repository model_repository

openai: setup     ## the OpenAI-compatible API on OPENAI_PORT, over the tritonserver of `make serve` (GRPC_PORT)
	$(PY) -m frontend --repository model_repository

demo: engines     ## start the server, call every model once (and the OpenAI API on OPENAI_PORT), stop it
	$(PY) -m client.demo

test: engines fp8-reference  ## the whole suite: unit tests and integration tests against a real tritonserver
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q --durations=25 tests  # no spinning OpenMP workers (README, QoS)

test-unit: setup fp8-reference
	$(PY) -m pytest -q tests/unit

fp8-reference: setup  ## SmolLM2 in FP8 written by llm-compressor itself (own venv); the FP8 tests load it
	$(PY) -c "from build_engines.gguf import pretrained_checkpoint; pretrained_checkpoint('smollm2')"
	test -x .venv-llmcompressor/bin/python || (python3 -m venv .venv-llmcompressor && \
	  .venv-llmcompressor/bin/pip install -q -r requirements-llmcompressor.txt)
	.venv-llmcompressor/bin/python scripts/llmcompressor_fp8.py .checkpoints/pretrained-smollm2 \
	  .checkpoints/smollm2-fp8-llmcompressor

stress: setup      ## heavy reliability runs (CPU): 4x capacity against bounded and unbounded queues, with memory
	$(PY) -m perf.overload

bench: engines genai-perf  ## perf scenarios (perf/) and the in-process LLM engine benchmark
	$(PY) -m perf
	$(PY) -m perf.llm_engine
	$(PY) -m perf.whisper_bench
	$(PY) -m perf.sam_bench --concurrency 1 4
	$(PY) -m build_engines vit --tiny --ensemble --repository .bench/ensembles
	$(PY) -m perf.ensemble_bench --models vit --variant single=model_repository --variant ensemble=.bench/ensembles
	$(PY) -m perf.openai_bench

bundle: setup     ## dist/*.tar.xz for an offline GPU host (BUNDLE_PYTHON=3.12); perf/gpu_bench.sh runs it there
	bash scripts/bundle.sh

genai-perf:       ## genai-perf in its own venv: make bench compares its LLM figures with ours
	test -x .venv-genai-perf/bin/genai-perf || \
	  (python3 -m venv .venv-genai-perf && .venv-genai-perf/bin/pip install -q genai-perf==0.0.8)

clean:
	rm -rf logs .pytest_cache model_repository/*/[0-9]* model_repository/*/warmup model_repository/*/labels.txt
