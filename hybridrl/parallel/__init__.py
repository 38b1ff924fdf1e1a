"""Parallel layouts and process-group setup. All rank arithmetic lives here."""
from hybridrl.parallel.layout import LayoutError, ParallelLayout, RankCoords, divisors

__all__ = ["LayoutError", "ParallelLayout", "RankCoords", "divisors"]
