"""Reference models."""
from .lstm_lm import LSTMLM

__all__ = ["LSTMLM"]
