"""The main process's side of a loader: everything ``SavableDataLoader`` runs itself.

Runs in the training process only, never in a worker. ``arguments`` checks the loader's
arguments, ``pipeline`` turns them into a pipeline and ``sampling`` draws what torch
draws at an epoch's start; ``iterator`` is what ``iter(loader)`` returns and ``stream``
one run of the workers (torch's iterator, the command channel's loader end, the
watchdog, with ``fetch_guard`` beside it); ``book`` keeps what was handed on, worker by
worker, and ``stops`` how a stream ends and keeps its position; ``shown`` is what the
loader shows of its arguments.
"""
