"""Metrics, statistics, trace and logging settings."""
