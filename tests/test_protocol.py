"""The Open Inference Protocol codec: JSON and binary tensors, BYTES framing, bad bodies."""

from __future__ import annotations

import gzip
import json
import re
import struct
import zlib

import numpy as np
import pytest

from overdrive.serve.protocol import HEADER_LENGTH, ProtocolError, TooLarge, decompress, encode_response, parse_request


def binary_request(tensors: list[tuple[str, str, np.ndarray | list[bytes]]]) -> tuple[bytes, str]:
    inputs, blobs = [], []
    for name, datatype, value in tensors:
        if datatype == "BYTES":
            raw = b"".join(struct.pack("<I", len(v)) + v for v in value)
            shape = [len(value)]
        else:
            raw, shape = value.tobytes(), list(value.shape)
        inputs.append({"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": len(raw)}})
        blobs.append(raw)
    header = json.dumps({"inputs": inputs}).encode()
    return header + b"".join(blobs), str(len(header))


@pytest.mark.parametrize("dtype,datatype", [(np.float32, "FP32"), (np.float16, "FP16"), (np.int64, "INT64"),
                                            (np.uint8, "UINT8"), (np.bool_, "BOOL"), (np.float64, "FP64")])
def test_binary_tensors_decode_to_the_same_array(dtype, datatype):
    x = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    body, length = binary_request([("a", datatype, x), ("b", "BYTES", [b"hi", b"", "✓".encode()])])
    request = parse_request(body, length)
    np.testing.assert_array_equal(request.inputs["a"].data, x)
    assert request.inputs["a"].data.dtype == dtype
    assert list(request.inputs["b"].data) == [b"hi", b"", "✓".encode()]


def test_responses_round_trip_as_json_and_binary():
    y = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    body, headers = encode_response("m", "id-1", [("output", y)], binary=set())
    doc = json.loads(body)
    assert doc["id"] == "id-1" and doc["outputs"][0]["shape"] == [3, 4]
    np.testing.assert_allclose(np.asarray(doc["outputs"][0]["data"], dtype=np.float32).reshape(3, 4), y)
    body, headers = encode_response("m", None, [("output", y)], binary={"output"})
    n = int(headers[HEADER_LENGTH])
    meta = json.loads(body[:n])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == y.nbytes
    np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.float32).reshape(3, 4), y)


BINARY = b'{"inputs": [{"name": "a", "datatype": "%s", "shape": [%d], "parameters": {"binary_data_size": %d}}]}'


@pytest.mark.parametrize("header,tail,message", [
    (BINARY % (b"FP32", 2, 8), b"\0" * 9, "1 bytes of binary data follow"),
    (BINARY % (b"FP32", 3, 8), b"\0" * 8, "3 FP32 elements need 12 bytes"),
    (BINARY % (b"BYTES", 1, 4), struct.pack("<I", 9), "claims 9 bytes"),
    (b"{}", 99, "Inference-Header-Content-Length is 99"),
    (b"{}", "x", "must be an integer"),
    (b'{"inputs": [{"name": "a", "datatype": "FP8", "shape": [1], "data": [1]}]}', None, "datatype 'FP8'"),
    (b'{"inputs": [{"name": "a", "datatype": "INT32", "shape": [1], "data": [1.5]}]}', None, "INT32 data must be int"),
    (b'{"inputs": [{"name": "a", "datatype": "INT8", "shape": [1], "data": [1000]}]}', None, "does not fit in INT8"),
    (b'{"inputs": [{"name": "a", "datatype": "BOOL", "shape": [1], "data": [1]}]}', None, "BOOL data must be bool"),
    (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None, "non-negative integers"),
    (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}, '
     b'{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}]}', None, "given twice"),
    (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]}', None, 'neither "data"'),
    (b'[1, 2]', None, "JSON object"),
    (b'\xff\xfe', None, "not valid JSON"),
    (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [1.0, true]}]}', None,
     "FP32 data must be float values, got True"),
    (b'{"inputs": [{"name": "a", "datatype": "FP32", "shape": [2], "data": [1.0, null]}]}', None, "got None"),
    (b'{"inputs": [{"name": "a", "datatype": "FP64", "shape": [1], "data": [-1e400]}]}', None,
     "does not fit in a 64-bit float"),
    (BINARY % (b"FP32", 1, 4) + b"\0\0\x80\x3f", None, "Inference-Header-Content-Length header (the JSON part's length"),
])
def test_bad_bodies_raise_protocol_errors_that_say_what_was_expected(header, tail, message):
    """`tail`: binary data after the JSON header (its length is then sent), or a bad header value."""
    if isinstance(tail, bytes):
        body, length = header + tail, str(len(header))
    else:
        body, length = header, (str(tail) if tail is not None else None)
    with pytest.raises(ProtocolError, match=re.escape(message)):
        parse_request(body, length)


def test_decompress_refuses_unknown_corrupt_truncated_or_oversized_bodies():
    data = b'{"inputs": []}' * 100
    assert decompress(gzip.compress(data), "gzip", 10_000) == data
    assert decompress(zlib.compress(data), "deflate", 10_000) == data
    with pytest.raises(ProtocolError, match="not supported"):
        decompress(b"x", "br", 100)
    with pytest.raises(ProtocolError, match="not valid gzip"):
        decompress(b"not gzip", "gzip", 100)
    with pytest.raises(ProtocolError, match="truncated"):
        decompress(gzip.compress(data)[:20], "gzip", 10_000)
    with pytest.raises(TooLarge, match="decompresses to more than 20000 bytes"):
        decompress(gzip.compress(b"\0" * 10**7), "gzip", 20_000)  # a 10 MB bomb in a ~10 kB body
    with pytest.raises(TooLarge):
        decompress(b"x" * 101, None, 100)


def test_a_huge_bytes_shape_with_little_data_is_refused_before_allocating():
    header = json.dumps({"inputs": [{"name": "b", "datatype": "BYTES", "shape": [10**9],
                                     "parameters": {"binary_data_size": 5}}]}).encode()
    with pytest.raises(ProtocolError, match="1000000000 BYTES elements need at least"):
        parse_request(header + struct.pack("<I", 1) + b"x", str(len(header)))


def test_deeply_nested_json_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_request(b"[" * 100_000 + b"]" * 100_000, None)
