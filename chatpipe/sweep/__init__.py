"""Sweeps: a grid of training runs described by a YAML file under ``sweeps/``.

- :mod:`chatpipe.sweep.spec`: the file's typed model, its points, their validation and price;
- :mod:`chatpipe.sweep.points`: one content-addressed work directory per point, its stages, its marker;
- :mod:`chatpipe.sweep.fit`: the isoFLOP fit (N_opt, D_opt, power laws, tokens:params ratio) and plots.

``flows/sweep.py`` runs a sweep as a Prefect flow.
"""
