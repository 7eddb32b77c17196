"""Stages over objects that keep their own position: torch's ``Stateful`` objects,
Hugging Face datasets, torchdata nodes (``stateful``, with ``stateful_values`` for the
values they save) and torch's ``IterDataPipe`` (``datapipes``). Runs wherever the
pipeline runs.
"""
