"""pagedserve's benchmarks: `python -m bench` lists them, `python -m bench NAME [ARGS]` runs one.

Each prints a table and writes JSON under bench/results/ (speed targets live here, never in tests).
"""
