"""Backends: the interface each implements, the factory, and the built-in ones (identity, ONNX
Runtime, TensorRT, the decoupled examples).
"""
