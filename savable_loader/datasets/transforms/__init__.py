"""The transforms: stages that read other stages. Runs wherever the pipeline runs.

``transform`` is their base; ``map``, ``filter``, ``shuffle``, ``limit``, ``repeat`` and
``blend`` (with ``blend_positions``, which lays a blend out by position) are the ones a
user chains; ``batch`` groups items and is the root of every loader's pipeline.
"""
