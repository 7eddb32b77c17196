"""Saved states meeting a loader: runs in the main process at save and restore time.

``layout`` describes a loader as its states see it (its pipeline, fingerprint and shape);
``compat`` checks that a state fits a loader and picks the state each rank restores;
``elastic`` moves a state onto another number of workers or ranks, running the pipeline's
cursors in the main process to do so.
"""
