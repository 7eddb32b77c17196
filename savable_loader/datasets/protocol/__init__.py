"""The pipeline protocol: what a stage, a cursor and a savable dataset promise.

Runs wherever a pipeline runs (each worker, or the main process). ``stage`` and
``cursor`` are the contract every source and transform keeps (NOTE [ The cursor contract
] in ``datasets/protocol/cursor.py``); ``elastic`` is what a stage is told when a state
moves to another layout; ``base`` is the protocol a dataset of your own implements.
"""
