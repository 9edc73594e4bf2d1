"""HTTP/2 (RFC 9113) as a pure state machine: frames, HPACK headers, flow-controlled sending. gRPC
runs on it.
"""
