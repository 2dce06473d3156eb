"""The shared estimator: standard library only (never Qt, pyqtgraph or torch)."""
