"""Long runs of the fuzzers under tests/fuzz/ (many seeds, replay, shrink), run through
`python -m benchmarks.fuzz NAME`; `make test` runs a few seeds of each."""
