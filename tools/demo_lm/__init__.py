"""The demo's pieces: corpus, model, the table of runs, the byte counter, training, report.

``python -m tools.demo`` (``hatch run demo``) is the entry point; see ``tools/demo.py``.
"""
