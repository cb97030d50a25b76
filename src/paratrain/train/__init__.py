"""Training loop, optimizer rules, checkpoints and metrics."""
from .loop import Trainer

__all__ = ["Trainer"]
