"""HTTP/1.1: the server, the KServe v2 endpoints and their routing table, the infer codec,
compressed bodies, the generate extension.
"""
