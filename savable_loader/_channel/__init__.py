"""What crosses between the main process and a worker: both sides import it.

``commands`` is the command channel (the commands, the loader's requests, the worker's
server thread and the stacks of a hung worker); ``events`` what a worker sends back with
its items (events, failures, progress); ``torch_compat`` the private names of torch's
``DataLoader`` that both sides rely on.
"""
