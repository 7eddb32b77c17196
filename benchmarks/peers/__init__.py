"""The peer comparison behind ``benchmarks/bench_peers.py``.

``workloads`` defines what every loader iterates (one dataset class, several item
costs, an image pipeline); ``adapters`` wraps each loader behind the same small
interface; ``plots`` draws the figures of ``docs/benchmarks.md``.
"""
