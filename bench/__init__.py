"""primerl's kernel microbenchmarks: `python -m bench <op> [--quick]`. See bench/harness.py."""
