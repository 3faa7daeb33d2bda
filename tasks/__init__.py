"""Prefect tasks: each a thin wrapper over one tilecast stage function."""
