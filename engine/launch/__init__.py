"""Starting the server: the command line, tritonserver's flags, and the launcher process that runs
the others.
"""
