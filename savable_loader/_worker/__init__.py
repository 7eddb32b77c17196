"""What runs the pipeline: in each worker process, or in the main process without them.

``wrapper`` is the dataset torch's ``DataLoader`` iterates (built in the main process,
pickled into each worker, where it starts the command thread that answers the loader);
``runtime`` drives the pipeline's cursor tree from what ``spec`` tells it (in a worker,
or in the main process when ``num_workers=0`` or during an elastic restore); ``ring``
keeps the worker's recent checkpoints, from which every save is answered.
"""
