"""The parts of benchmarks/scale.py (issue 36), which loads them by path: ``load``
(the users, items and their events), ``worker`` (the regional worker's runtime with
in-memory ports and a file for a broker), ``modes`` (states in memory or on disk),
``bulk`` (a state built in bulk at the large sizes) and ``report`` (tables, plot)."""
