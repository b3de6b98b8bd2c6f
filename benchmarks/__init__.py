"""The benchmarks, run from the repository root as modules: `python -m benchmarks.NAME --help`.

`benchmarks.harness` is what they share (interleaved timing, memory probes, metadata, result files);
benchmarks/NOTES.md is the lab notebook, benchmarks/results/ what they wrote.
"""
