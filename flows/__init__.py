"""Prefect flows: the nightly DAG."""
