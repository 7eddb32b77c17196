"""Glue for training frameworks, one module each, imported only when used.

- ``savable_loader.integrations.lightning``: PyTorch Lightning (the ``lightning`` extra).
- ``savable_loader.integrations.accelerate``: Hugging Face Accelerate (the ``accelerate``
  extra).
- ``savable_loader.integrations.hf_trainer``: the Hugging Face ``Trainer`` (the
  ``transformers`` extra).

Importing this package imports no framework.
"""
