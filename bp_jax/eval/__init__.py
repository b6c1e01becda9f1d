"""Evaluation output: reports, plots, resource figures."""
