"""Reference models: one file each (LSTM LM, GPT, BatchNorm CNN)."""
from .cnn import DigitsCNN
from .gpt import GPT
from .lstm_lm import LSTMLM

__all__ = ["LSTMLM", "GPT", "DigitsCNN"]
