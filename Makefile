# The two commands of the README's quickstart. Each sets everything up (once) and runs its job.
.PHONY: demo test lint bench setup

setup:
	@bash scripts/bootstrap.sh

demo: setup
	.venv/bin/padfree demo

test: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python -m pip install --quiet -e '.[bench]'
	.venv/bin/python benchmarks/bench_packing.py
	.venv/bin/python benchmarks/bench_datasets.py
	.venv/bin/python benchmarks/bench_collate.py
	.venv/bin/python benchmarks/bench_attention.py
	.venv/bin/python benchmarks/bench_training.py
	.venv/bin/python benchmarks/bench_mixers.py
