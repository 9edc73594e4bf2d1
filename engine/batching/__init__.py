"""Batching rules: the queues, Triton's dynamic and sequence batchers, the rate limiter. Pure
objects the scheduler runs, and a leased worker too.
"""
