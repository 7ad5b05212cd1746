"""The benchmarks of scripts/bench.py, one module each (`pair`: against TRL, the default; `video`; `packing`;
`staleness`), and what they share (`common`)."""
