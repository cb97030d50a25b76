"""Measurement: per-step timing, the scaling sweep (``paratrain bench``), its report, and the
alpha-beta cost model (``paratrain predict``)."""
