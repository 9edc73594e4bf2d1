"""A worker's side of leases: batching and sequences of requests sent to it directly, and pipeline
steps handed worker to worker.
"""
