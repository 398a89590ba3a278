"""KServe v2 gRPC (`inference.GRPCInferenceService`, the service `tritonclient.grpc` speaks) on
the same event loop and the same batchers as HTTP: a gRPC request and an HTTP request for the
same model join the same batches.

Served: ServerLive, ServerReady, ServerMetadata, ModelMetadata, ModelReady, ModelConfig (name,
batch size, inputs and outputs), ModelInfer (inputs as `raw_input_contents` or typed
`contents`; outputs always as `raw_output_contents`, as Triton answers), RepositoryIndex,
RepositoryModelLoad, RepositoryModelUnload. The others (statistics, shared memory, tracing, log
settings, streaming) answer UNIMPLEMENTED with the method's name.

Errors map from the HTTP statuses (`app.InferError`) as Triton maps them: 400 INVALID_ARGUMENT,
404 NOT_FOUND, 413 RESOURCE_EXHAUSTED, 500 INTERNAL, 503 UNAVAILABLE,
504 DEADLINE_EXCEEDED. A call's gRPC deadline, when shorter, is its queue timeout. A client that
cancels a call drops its request from the queue (the batcher sees the handler cancelled).

The messages are the generated ones `tritonclient` ships (`tritonclient.grpc.service_pb2`),
from Triton's `grpc_service.proto`.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from overdrive.core.errors import ConfigError, arg
from overdrive.serve.app import InferenceServer, InferError
from overdrive.serve.protocol import InferRequest, ProtocolError, datatype_of, tensor_from_raw, tensor_from_values

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED, 500: grpc.StatusCode.INTERNAL,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def _parameters(params) -> dict:
    """A protobuf map<string, InferParameter> as plain values."""
    out = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which else None
    return out


def infer_request(request: pb.ModelInferRequest) -> tuple[InferRequest, int]:
    """The decoded request (the same `InferRequest` HTTP gives) and its size in bytes.

    Raises:
        ProtocolError: naming what does not decode.
    """
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs; give one per input, or "
                            "none and typed contents")
    inputs, size = {}, 0
    for i, t in enumerate(request.inputs):
        shape = [int(d) for d in t.shape]
        if raw:
            tensor = tensor_from_raw(t.name, t.datatype, shape, raw[i])
            size += len(raw[i])
        else:
            field = _CONTENTS.get(t.datatype)
            if field is None:
                raise ProtocolError(f"input {t.name!r}: {t.datatype} has no typed contents field; send it in "
                                    "raw_input_contents")
            values = list(getattr(t.contents, field))
            tensor = tensor_from_values(t.name, t.datatype, shape, values)
            size += tensor.data.nbytes if t.datatype != "BYTES" else sum(len(v) for v in values)
        if tensor.name in inputs:
            raise ProtocolError(f"input {tensor.name!r} is given twice")
        inputs[tensor.name] = tensor
    if not inputs:
        raise ProtocolError("the request has no inputs")
    parameters = _parameters(request.parameters)
    return InferRequest(id=request.id or None, inputs=inputs, outputs={o.name: True for o in request.outputs},
                        parameters=parameters, binary_outputs=True), size


class Servicer(pbg.GRPCInferenceServiceServicer):
    """The gRPC face of an `InferenceServer`."""

    def __init__(self, server: InferenceServer):
        self.server = server

    async def _slot(self, name: str, version: str, context):
        try:
            return self.server.slot(name, version)
        except InferError as exc:
            await context.abort(_CODES[exc.status], str(exc))

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.server.is_ready)

    async def ServerMetadata(self, request, context):
        meta = self.server.metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"], extensions=meta["extensions"])

    async def ModelReady(self, request, context):
        slot = await self._slot(request.name, request.version, context)
        return pb.ModelReadyResponse(ready=slot.ready and not self.server.draining)

    async def ModelMetadata(self, request, context):
        slot = await self._slot(request.name, request.version, context)
        if slot.served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"model {slot.name!r} is unloaded")
        meta = slot.served.metadata()
        tensors = lambda specs: [pb.ModelMetadataResponse.TensorMetadata(**s) for s in specs]  # noqa: E731
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=tensors(meta["inputs"]), outputs=tensors(meta["outputs"]))

    async def ModelConfig(self, request, context):
        slot = await self._slot(request.name, request.version, context)
        doc = self.server.model_config_dict(slot)
        io = lambda specs, cls: [cls(name=s["name"], data_type=mc.DataType.Value(  # noqa: E731
            "TYPE_STRING" if s["datatype"] == "BYTES" else "TYPE_" + s["datatype"]), dims=s["shape"][1:]) for s in specs]
        dyn = doc["dynamic_batching"]
        config = mc.ModelConfig(name=doc["name"], max_batch_size=doc["max_batch_size"], platform="pytorch_overdrive",
                                input=io(doc.get("input", []), mc.ModelInput), output=io(doc.get("output", []), mc.ModelOutput),
                                dynamic_batching=mc.ModelDynamicBatching(
                                    max_queue_delay_microseconds=dyn["max_queue_delay_microseconds"]))
        return pb.ModelConfigResponse(config=config)

    async def RepositoryIndex(self, request, context):
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m)
                                                  for m in self.server.index(request.ready)])

    async def RepositoryModelLoad(self, request, context):
        await self._repository(self.server.load, request.model_name, context)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._repository(self.server.unload, request.model_name, context)
        return pb.RepositoryModelUnloadResponse()

    @staticmethod
    async def _repository(action, name: str, context) -> None:
        try:
            await action(name)
        except InferError as exc:
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), str(exc))

    async def ModelInfer(self, request, context):
        started = time.perf_counter()
        slot = await self._slot(request.model_name, request.model_version, context)
        try:
            try:
                parsed, size = infer_request(request)
            except ProtocolError as exc:
                slot.metrics.rejected("invalid")
                raise InferError(400, str(exc)) from None
            remaining = context.time_remaining()
            if remaining is not None:  # the call's deadline bounds its time in the queue
                ours = parsed.parameters.get("timeout")
                parsed.parameters["timeout"] = max(1, int(min(remaining * 1e6, ours or float("inf"))))
            parts = await self.server.run(slot, parsed, size)
        except InferError as exc:
            if exc.status != 499:
                slot.metrics.answered(exc.status, started)
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), str(exc))
        response = pb.ModelInferResponse(model_name=slot.name, model_version="1", id=request.id)
        for name, array in parts:
            array = np.ascontiguousarray(array)
            response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=list(array.shape))
            response.raw_output_contents.append(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
        slot.metrics.answered(200, started)
        return response


def _unimplemented(method: str):
    async def call(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"overdrive does not implement {method}; the KServe v2 core "
                            "(health, metadata, ModelInfer) and the repository calls are served")
    call.__name__ = method
    return call


for _method in ("ModelStatistics", "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting",
                "LogSettings", "ModelStreamInfer"):
    setattr(Servicer, _method, _unimplemented(_method))


async def start_grpc(server: InferenceServer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC service on the running event loop. Returns (the grpc.aio server, the bound port).

    Raises:
        ConfigError: the port cannot be bound.
    """
    limit = server.config.max_request_bytes
    grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                           ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)])
    pbg.add_GRPCInferenceServiceServicer_to_server(Servicer(server), grpc_server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = grpc_server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise ConfigError(f"cannot listen for gRPC on {address}; choose another {arg('grpc_port')}")
    await grpc_server.start()
    return grpc_server, bound
