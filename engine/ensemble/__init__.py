"""Ensembles: the checked data flow of a pipeline, running it in the scheduler, and lending it to
run worker to worker.
"""
