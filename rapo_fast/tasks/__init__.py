"""Synthetic multi-step tool tasks shipped with the package (no downloads), used by the demo and the tests."""
