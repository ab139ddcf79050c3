# The two commands of the README's "Set up and test". Each sets everything up (once) and runs its job.
# `make test` installs the exact versions of constraints/ci.txt; `make test-floor` the floors of pyproject.toml
# (constraints/floor.txt) in .venv-floor, and runs the tests that prove them; `make wheel` builds the package and
# checks it installed on its own (CI runs it after the tests).
.PHONY: demo test test-floor wheel lint bench setup

setup:
	@bash scripts/bootstrap.sh

demo: setup
	.venv/bin/padfree demo

# two workers: the suite is mostly independent tiny-model proofs (the support sweep alone is ~300 of them); a worker
# that runs out of tests takes the other's (worksteal), so a long test near the end does not leave a core idle
test: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=15

# the exactness matrix and the trainers (transformers, TRL, accelerate), the data layer (datasets, pyarrow), the
# CLI (tokenizers, matplotlib), the packing kernels (numpy, numba) and sequence parallelism (accelerate's loaders,
# gloo): about 13 minutes on a 2-core machine
FLOOR_TESTS = tests/proof/test_model_sweep.py tests/proof/test_model_certify.py \
	tests/integrations/test_integrations_bf16.py tests/model/test_model_matrix.py tests/model/test_model_mixers.py \
	tests/model/test_model_configure.py tests/integrations/test_integrations_trainer.py \
	tests/integrations/test_integrations_sft.py tests/data/test_data_hf.py tests/data/test_data_datasets.py \
	tests/cli/test_cli.py tests/packing/test_packing.py tests/test_rows.py tests/sequence_parallel/test_sequence_parallel.py \
	tests/model/test_model_sharded.py tests/integrations/test_integrations_sequence_parallel.py \
	tests/integrations/test_integrations_balanced_trainer.py tests/model/families/test_families_depth.py \
	tests/model/test_model_attention.py

# the sdist and the wheel built, the wheel installed with every extra into a venv without the checkout, the README's
# example and `padfree --help` run there: about 5 minutes on a 2-core machine the first time, 1 minute afterwards
wheel: setup
	bash scripts/check_wheel.sh

test-floor:
	@PADFREE_VENV=.venv-floor PADFREE_CONSTRAINTS=constraints/floor.txt PADFREE_SYSTEM_SITE=0 bash scripts/bootstrap.sh
	.venv-floor/bin/python -m ruff check .
	.venv-floor/bin/python -m pytest -q -n 2 --dist worksteal $(FLOOR_TESTS)

bench: setup
	.venv/bin/python -m pip install --quiet -c .venv/constraints.txt -e '.[bench]'
	.venv/bin/python benchmarks/bench_packing.py
	.venv/bin/python benchmarks/bench_datasets.py
	.venv/bin/python benchmarks/bench_collate.py
	.venv/bin/python benchmarks/bench_attention.py
	.venv/bin/python benchmarks/bench_training.py
	.venv/bin/python benchmarks/bench_mixers.py
	.venv/bin/python benchmarks/bench_certify.py
	.venv/bin/python benchmarks/bench_sequence_parallel.py
