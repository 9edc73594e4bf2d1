"""The ``expression`` backend: a model whose outputs are numpy expressions of its inputs, written
in its config. It ships with shmserve as an example of a python-based backend (one model.py
that serves every model naming it, as Triton's python-based backends do).

    backend: "expression"
    input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
    parameters: { key: "Y" value: { string_value: "tanh(X) * 2 + 1" } }

An expression may use the inputs by name, numbers, + - * / // % **, comparisons, unary -, and
the functions in FUNCTIONS. Nothing else parses: an expression is data, never code, so a config
from an upload cannot run anything through it.
"""
import ast
import json
from typing import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

FUNCTIONS: dict[str, Callable] = {
    "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh,
    "sin": np.sin, "cos": np.cos, "maximum": np.maximum, "minimum": np.minimum,
    "clip": np.clip, "where": np.where, "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}
BINARY = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.divide,
          ast.FloorDiv: np.floor_divide, ast.Mod: np.mod, ast.Pow: np.power}
COMPARE = {ast.Lt: np.less, ast.LtE: np.less_equal, ast.Gt: np.greater,
           ast.GtE: np.greater_equal, ast.Eq: np.equal, ast.NotEq: np.not_equal}
MAX_EXPRESSION_CHARS = 4096


def compile_expression(text, inputs):
    """The checked tree of ``text``; ValueError names what is not allowed."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in inputs and node.id not in FUNCTIONS:
                raise ValueError(f"unknown name '{node.id}' (inputs: {', '.join(inputs)}; "
                                 f"functions: {', '.join(FUNCTIONS)})")
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
                raise ValueError(f"only calls of {', '.join(FUNCTIONS)} with plain arguments")
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float)) or isinstance(node.value, bool):
                raise ValueError(f"constant {node.value!r} is not a number")
        elif not isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.Load, ast.USub,
                                   ast.UAdd, *BINARY, *COMPARE)):
            raise ValueError(f"'{type(node).__name__}' is not allowed")
    return tree


def evaluate(node, values):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.BinOp):
        return BINARY[type(node.op)](evaluate(node.left, values), evaluate(node.right, values))
    if isinstance(node, ast.UnaryOp):
        value = evaluate(node.operand, values)
        return np.negative(value) if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Compare):
        result, left = True, evaluate(node.left, values)
        for op, right_node in zip(node.ops, node.comparators):
            right = evaluate(right_node, values)
            result = np.logical_and(result, COMPARE[type(op)](left, right))
            left = right
        return result
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return FUNCTIONS[node.func.id](*(evaluate(a, values) for a in node.args))
    raise ValueError(f"'{type(node).__name__}' is not allowed")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in config.get("input", [])]
        params = config.get("parameters") or {}
        self.outputs = []
        for out in config.get("output", []):
            name = out["name"]
            text = (params.get(name) or {}).get("string_value", "")
            if not text:
                raise pb_utils.TritonModelException(
                    f"model '{args['model_name']}': output '{name}' needs its expression in "
                    f"parameters {{ key: \"{name}\" value: {{ string_value: \"...\" }} }}")
            try:
                tree = compile_expression(text, self.inputs)
            except ValueError as e:
                raise pb_utils.TritonModelException(
                    f"model '{args['model_name']}': the expression of output '{name}' "
                    f"({text!r}): {e}") from None
            dtype = pb_utils.triton_string_to_numpy(out["data_type"].replace("TYPE_", ""))
            self.outputs.append((name, tree, dtype))

    def execute(self, requests):
        responses = []
        for request in requests:
            values = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy()
                      for n in self.inputs}
            shape = np.broadcast_shapes(*(v.shape for v in values.values())) if values else ()
            tensors = []
            try:
                with np.errstate(all="ignore"):     # inf and nan are answers, as in numpy
                    for name, tree, dtype in self.outputs:
                        result = np.broadcast_to(np.asarray(evaluate(tree, values)), shape)
                        tensors.append(pb_utils.Tensor(name, np.ascontiguousarray(result, dtype)))
            except (ValueError, TypeError) as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"the expression failed on this request: {e}")))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
