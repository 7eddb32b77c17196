"""The node-local cache of remote files, shared by the workers and ranks of one node.

Runs in every process that reads remote files through a source with ``cache_dir``.
``node`` is the cache (NOTE [ File cache ] in ``storage/cache/node.py``); ``entries`` an
entry on disk and its validity; ``download`` an entry read while it downloads, ``probe``
a file's signature and first bytes in one request; ``held`` the locks that keep entries;
``evict`` keeps the folder under its limit.
"""
