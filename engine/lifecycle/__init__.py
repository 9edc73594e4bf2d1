"""Models on disk and in memory: the repository, loading, reloading and unloading, on-demand
residency, uploads.
"""
