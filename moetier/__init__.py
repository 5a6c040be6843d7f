"""moetier: serve Mixture-of-Experts models larger than GPU memory."""

__version__ = "0.1.0"
