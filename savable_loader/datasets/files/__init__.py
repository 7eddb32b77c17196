"""The sources read from files: JSON lines, tar shards, token files and tables.

Runs wherever the pipeline runs, and in the main process when a loader is built (the
listing and the counting of samples). ``sharded`` is the base of the sharded sources
(``jsonl``, ``tar``) and ``cursor`` their cursor; ``sample_split``, ``positions`` and
``reshard`` share an epoch out over streams and move it to another layout;
``file_list``, ``access`` and ``counts_file`` list, reach and count the files;
``tokens`` and ``table`` (with ``table_read`` and ``table_fetch``) are the index-driven
file sources.
"""
