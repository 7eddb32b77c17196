"""Glue for training frameworks, one module each, imported only when used.

``savable_loader.integrations.lightning``: PyTorch Lightning (the ``lightning`` extra).
Importing this package imports no framework.
"""
