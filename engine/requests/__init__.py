"""What every submitter of a request does before the scheduler sees it: the model catalog and the
request checks. Used by the frontend and by a python model's BLS client alike.
"""
