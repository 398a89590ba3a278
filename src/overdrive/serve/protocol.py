"""The Open Inference Protocol (KServe v2) tensor codec: JSON tensors and the binary tensor
data extension that `tritonclient.http` sends and expects.

Sources: the KServe "Open Inference Protocol (v2)" REST spec (`$inference_request`,
`$inference_response`, tensor data row-major and flattened or nested) and Triton Inference
Server's binary tensor data extension (`Inference-Header-Content-Length`, per-tensor
`binary_data_size`, BYTES elements as 4-byte little-endian length + bytes).
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"
MAX_DIMS = 32

DATATYPES: dict[str, np.dtype | None] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BYTES": None,  # a list of bytes objects
}


class ProtocolError(ValueError):
    """A request the protocol cannot decode; the message names what was expected (HTTP 400)."""


def datatype_of(dtype: np.dtype) -> str:
    for name, dt in DATATYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"no Open Inference Protocol datatype for numpy {dtype}")


@dataclass
class Tensor:
    """One named tensor. `data` is a numpy array of `shape`, or for BYTES an object array of
    bytes of that shape."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass
class InferRequest:
    id: str | None
    inputs: dict[str, Tensor]
    outputs: dict[str, bool]  # requested output name → binary; empty means all outputs
    parameters: dict[str, Any] = field(default_factory=dict)
    binary_outputs: bool = False  # request-level `binary_data_output`


class TooLarge(ProtocolError):
    """A body over the server's size limit (HTTP 413)."""


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo `Content-Encoding: gzip | deflate` (what tritonclient's request compression sends).

    Raises:
        ProtocolError: an unknown encoding or corrupt data.
        TooLarge: the body, or what it decompresses to, is over `limit` bytes.
    """
    if len(body) > limit:
        raise TooLarge(f"the body is {len(body)} bytes; this server takes at most {limit}")
    if not encoding or encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported; expected gzip, deflate or none")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)  # 31: gzip header, 15: zlib
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ProtocolError(f"the body is not valid {encoding} data ({exc})") from None
    if len(out) > limit:
        raise TooLarge(f"the body decompresses to more than {limit} bytes, the most this server takes")
    if not inflater.eof:
        raise ProtocolError(f"the body is not valid {encoding} data (truncated)")
    return out


def parse_request(body: bytes, header_length: str | None) -> InferRequest:
    """Decode an inference request body.

    Args:
        body: the (decompressed) HTTP body.
        header_length: the `Inference-Header-Content-Length` header, when binary data follows.

    Raises:
        ProtocolError: invalid JSON, a malformed tensor, or binary sizes that do not add up.
    """
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= n <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH} is {n} but the body has {len(body)} bytes")
        header, binary = body[:n], memoryview(body)[n:]
    else:
        header, binary = body, memoryview(b"")
    try:
        doc = json.loads(header, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        if header_length is None and _json_then_bytes(header):
            raise ProtocolError(f"the body is a JSON header followed by binary data, but the {HEADER_LENGTH} header "
                                "(the JSON part's length in bytes) is missing; the binary tensor data extension "
                                "needs it") from None
        raise ProtocolError(f"the request is not valid JSON ({exc})") from None
    except RecursionError:
        raise ProtocolError("the request JSON is nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise ProtocolError('expected a JSON object with a non-empty "inputs" list')
    parameters = _object(doc.get("parameters", {}), "parameters")
    inputs: dict[str, Tensor] = {}
    offset = 0
    for i, spec in enumerate(doc["inputs"]):
        tensor, used = _parse_tensor(spec, i, binary[offset:])
        offset += used
        if tensor.name in inputs:
            raise ProtocolError(f"input {tensor.name!r} is given twice")
        inputs[tensor.name] = tensor
    if offset != len(binary):
        raise ProtocolError(f"{len(binary) - offset} bytes of binary data follow the inputs that no input claims")
    outputs = {}
    for spec in doc.get("outputs") or []:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError('each requested output must be an object with a "name"')
        outputs[spec["name"]] = bool(_object(spec.get("parameters", {}), "output parameters").get("binary_data", False))
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f'"id" must be a string, got {type(request_id).__name__}')
    return InferRequest(id=request_id, inputs=inputs, outputs=outputs,
                        parameters=parameters, binary_outputs=bool(parameters.get("binary_data_output", False)))


_SHAPE = re.compile(rb'"shape"\s*:\s*\[\s*(\d{1,18})')


def leading_rows(body: bytes) -> int | None:
    """The largest first dimension among the `"shape": [N, ...]` of a JSON request, found by a scan
    of the bytes (milliseconds for 60 MB, where json.loads takes seconds); None when there is none.
    Inside JSON strings quotes are escaped, so a `"shape"` key can only be a key."""
    found = [int(m.group(1)) for m in _SHAPE.finditer(body)]
    return max(found) if found else None


def _json_then_bytes(body: bytes) -> bool:
    """Whether `body` starts with a whole JSON object that more bytes follow (a binary body sent
    without its header length)."""
    try:
        _, end = json.JSONDecoder().raw_decode(body.decode("utf-8", errors="replace"))
    except ValueError:
        return False
    return end < len(body)


def _no_constant(name: str):
    raise ProtocolError(f"{name} is not JSON (RFC 8259); send non-finite values as binary tensor data")


def _object(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ProtocolError(f'"{what}" must be a JSON object')
    return value


def check_tensor_spec(name: Any, datatype: Any, shape: Any, where: str) -> None:
    """A tensor's name, datatype and shape as the protocol allows them.

    Raises:
        ProtocolError: naming what is wrong.
    """
    if not isinstance(name, str) or not name:
        raise ProtocolError(f'{where} needs a "name" string')
    if datatype not in DATATYPES:
        raise ProtocolError(f"{where}: datatype {datatype!r} is not one of {', '.join(DATATYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f'{where}: "shape" must be a list of non-negative integers, got {shape!r}')
    if len(shape) > MAX_DIMS:
        raise ProtocolError(f"{where}: shape has {len(shape)} dimensions; at most {MAX_DIMS} are accepted")


def tensor_from_raw(name: str, datatype: str, shape: list[int], raw: bytes) -> Tensor:
    """A tensor from its raw little-endian bytes (gRPC `raw_input_contents`, the HTTP binary
    extension): fixed-size elements row-major, BYTES as 4-byte length + bytes per element.

    Raises:
        ProtocolError: a bad name, datatype or shape, or bytes that do not fill the shape.
    """
    where = f"input {name!r}"
    check_tensor_spec(name, datatype, shape, where)
    count = math.prod(shape)
    data = _bytes_elements(raw, count, where) if datatype == "BYTES" else _fixed_from_binary(raw, datatype, count, where)
    return Tensor(name=name, datatype=datatype, shape=tuple(shape), data=data.reshape(shape))


def tensor_from_values(name: str, datatype: str, shape: list[int], values: list) -> Tensor:
    """A tensor from a flat list of values (gRPC `InferTensorContents`; BYTES as bytes objects).

    Raises:
        ProtocolError: as `tensor_from_raw`, or values of the wrong kind or count.
    """
    where = f"input {name!r}"
    check_tensor_spec(name, datatype, shape, where)
    if len(values) != math.prod(shape):
        raise ProtocolError(f"{where}: shape {list(shape)} holds {math.prod(shape)} elements but the contents have "
                            f"{len(values)}")
    if datatype == "BYTES":
        data = np.empty(len(values), dtype=object)
        data[:] = list(values)
    else:
        try:
            data = np.asarray(values, dtype=DATATYPES[datatype])
        except (OverflowError, ValueError):
            raise ProtocolError(f"{where}: a value does not fit in {datatype}") from None
    return Tensor(name=name, datatype=datatype, shape=tuple(shape), data=data.reshape(shape))


def _parse_tensor(spec: Any, index: int, binary: memoryview) -> tuple[Tensor, int]:
    if not isinstance(spec, dict):
        raise ProtocolError(f"inputs[{index}] must be a JSON object")
    name, datatype, shape = spec.get("name"), spec.get("datatype"), spec.get("shape")
    where = f"input {name!r}" if isinstance(name, str) else f"inputs[{index}]"
    check_tensor_spec(name, datatype, shape, where)
    count = math.prod(shape)
    params = _object(spec.get("parameters", {}), f"{where} parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or size > len(binary):
            raise ProtocolError(f"{where}: binary_data_size {size!r} but {len(binary)} bytes of binary data remain")
        raw = bytes(binary[:size])
        data = _bytes_elements(raw, count, where) if datatype == "BYTES" else _fixed_from_binary(raw, datatype, count, where)
        used = size
    else:
        if "data" not in spec:
            raise ProtocolError(f'{where} has neither "data" nor a binary_data_size parameter')
        data = _from_json(spec["data"], datatype, tuple(shape), where)
        used = 0
    return Tensor(name=name, datatype=datatype, shape=tuple(shape), data=data.reshape(shape)), used


def _flatten(value: Any, shape: tuple[int, ...], where: str) -> list:
    """Row-major elements of `value`: a flat list of all elements, or lists nested exactly as `shape`."""
    if not isinstance(value, list):
        raise ProtocolError(f'{where}: "data" must be a JSON list, got {type(value).__name__}')
    count = math.prod(shape)
    if not any(isinstance(v, list) for v in value):
        if len(value) != count:
            raise ProtocolError(f"{where}: shape {list(shape)} holds {count} elements but data has {len(value)}")
        return value
    out: list = []

    def walk(v: Any, depth: int, path: str) -> None:
        if depth == len(shape):
            if isinstance(v, list):
                raise ProtocolError(f"{where}: data{path} is nested deeper than shape {list(shape)}")
            out.append(v)
            return
        if not isinstance(v, list) or len(v) != shape[depth]:
            got = f"{len(v)} items" if isinstance(v, list) else type(v).__name__
            raise ProtocolError(f"{where}: data{path} must be a list of {shape[depth]} items for shape {list(shape)}, got {got}")
        for i, item in enumerate(v):
            walk(item, depth + 1, f"{path}[{i}]")

    walk(value, 0, "")
    return out


def _from_json(value: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    flat = _flatten(value, shape, where)
    count = len(flat)
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise ProtocolError(f"{where}: BYTES data in JSON must be strings")
        out = np.empty(count, dtype=object)
        try:
            out[:] = [v.encode("utf-8") for v in flat]
        except UnicodeEncodeError as exc:  # a lone surrogate such as "\ud800"
            raise ProtocolError(f"{where}: a BYTES string is not valid UTF-8 ({exc.reason})") from None
        return out
    dtype = DATATYPES[datatype]
    kind = bool if datatype == "BOOL" else (float if dtype.kind == "f" else int)
    allowed = {bool} if kind is bool else ({int, float} if kind is float else {int})
    if not set(map(type, flat)) <= allowed:  # json gives exactly int, float, bool, str, None, list, dict
        bad = next(v for v in flat if type(v) not in allowed)
        raise ProtocolError(f"{where}: {datatype} data must be {kind.__name__} values, got {bad!r}")
    try:
        if kind is float:
            wide = np.asarray(flat, dtype=np.float64)
            if not np.isfinite(wide).all():  # NaN and Infinity tokens are refused by the parser: this overflowed
                raise ProtocolError(f"{where}: a value does not fit in a 64-bit float (beyond ±1.8e308); send non-finite "
                                    "values as binary tensor data")
            return wide.astype(dtype)
        return np.asarray(flat, dtype=dtype)
    except OverflowError:
        raise ProtocolError(f"{where}: a value does not fit in {datatype}") from None


def _fixed_from_binary(raw: bytes, datatype: str, count: int, where: str) -> np.ndarray:
    dtype = DATATYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(f"{where}: {count} {datatype} elements need {count * dtype.itemsize} bytes, got {len(raw)}")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=True)


def _bytes_elements(raw: bytes, count: int, where: str) -> np.ndarray:
    if 4 * count > len(raw):  # each element has a 4-byte length: refuse before allocating `count` slots
        raise ProtocolError(f"{where}: {count} BYTES elements need at least {4 * count} bytes, got {len(raw)}")
    out = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(raw):
            raise ProtocolError(f"{where}: BYTES data ends before element {i} of {count}")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + n > len(raw):
            raise ProtocolError(f"{where}: BYTES element {i} claims {n} bytes, {len(raw) - offset} remain")
        out[i] = raw[offset : offset + n]
        offset += n
    if offset != len(raw):
        raise ProtocolError(f"{where}: {len(raw) - offset} bytes left after {count} BYTES elements")
    return out


def encode_response(model_name: str, request_id: str | None, outputs: list[tuple[str, np.ndarray]],
                    binary: set[str]) -> tuple[bytes, dict[str, str]]:
    """Encode an inference response; outputs named in `binary` go as binary tensor data.

    Returns:
        (body, extra headers): `Inference-Header-Content-Length` is set when binary data follows.
    """
    doc: dict[str, Any] = {"model_name": model_name, "model_version": "1", "outputs": []}
    if request_id is not None:
        doc["id"] = request_id
    chunks = []
    for name, array in outputs:
        array = np.ascontiguousarray(array)
        spec: dict[str, Any] = {"name": name, "datatype": datatype_of(array.dtype), "shape": list(array.shape)}
        if name in binary:
            raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            spec["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            spec["data"] = array.reshape(-1).tolist()
        doc["outputs"].append(spec)
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, {}
    return b"".join([header, *chunks]), {HEADER_LENGTH: str(len(header))}


def error_body(message: str) -> bytes:
    """The protocol's error object, `{"error": "..."}`."""
    return json.dumps({"error": message}).encode()
