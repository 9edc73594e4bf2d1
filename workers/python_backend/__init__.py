"""The python backend: running a repository's model.py, triton_python_backend_utils, BLS calls and
model control from inside a model.
"""
