"""Inputs that look enough like real requests to get past the first check, with every field
free to be wrong: the names a model has mixed with any text, real datatypes mixed with junk,
shapes with huge and negative dims, values of every JSON type."""
from hypothesis import strategies as st

WIRE_TYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
              "FP16", "FP32", "FP64", "BF16", "BYTES"]
NAMES = ["A", "B", "C", "X", "Y", "R", "S", "H", "BF", "U", "V", "OUT0", "OUT1", "Z", "O"]

big_ints = st.one_of(st.integers(-3, 10), st.integers(-(2 ** 70), 2 ** 70))
scalars = st.one_of(st.none(), st.booleans(), big_ints,
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=30)
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=6))
datatypes = st.one_of(st.sampled_from(WIRE_TYPES), st.text(max_size=6))
shapes = st.lists(big_ints, max_size=4)
param_keys = st.one_of(st.sampled_from(["binary_data_size", "binary_data", "shared_memory_region",
                                        "shared_memory_byte_size", "shared_memory_offset",
                                        "classification", "priority", "timeout", "sequence_id",
                                        "sequence_start", "sequence_end", "binary_data_output",
                                        "triton_x"]), st.text(max_size=6))
params = st.dictionaries(param_keys, json_values, max_size=3)
