"""Launching DAPO jobs: ``slurm`` (the in-allocation driver, ``dapo launch``) and ``nemo`` (nemo-run submission).

Import the submodules directly; nothing here pulls in torch or nemo-run.
"""
