"""The gRPC front door: a grpc.aio server in the gateway process, on the same event loop and the
same Frontend as HTTP (`--grpc-port`; 0 = off).

    Generate ─► auth (metadata `authorization: Bearer`) ─► to_api_request (HTTP's pydantic models
    and caps) ─► Frontend.submit ─► Generation.updates() ─► a GenerateResponse per choice update

A cancelled call (the client went away or its deadline passed) cancels the handler task; an Abort
call puts an error into the generation's reply queue, which ends the stream with CANCELLED. Either
way Generation.updates() ends in its `finally`, and the Frontend sends Abort to the engine.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pagedserve.services.gateway.auth import is_authorized
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.grpc_api import convert
from pagedserve.services.gateway.grpc_api import pagedserve_pb2 as pb
from pagedserve.services.gateway.grpc_api import pagedserve_pb2_grpc as pb_grpc
from pagedserve.shared.config import GatewayConfig
from pagedserve.shared.protocol import RequestError

log = logging.getLogger(__name__)
SERVICE_NAME = "pagedserve.v1.Generation"
_SHUTDOWN_GRACE_S = 30.0  # as uvicorn's graceful shutdown


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, settings: GatewayConfig) -> None:
        self.frontend, self.settings = frontend, settings
        self.keys = [k.encode() for k in settings.api_keys]
        self.running: dict[str, Generation] = {}  # by the id the client knows
        self.claimed: set[str] = set()  # client ids taken, from before submit until the call ends

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        await self._authorize(context)
        client_id = request.request_id
        if client_id in self.claimed:  # checked and claimed with no await between: two calls can't both pass
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {client_id!r} is running")
        if client_id:
            self.claimed.add(client_id)
        try:
            async for response in self._generate(request, context):
                yield response
        finally:
            self.claimed.discard(client_id)

    async def _generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        try:
            req = convert.to_api_request(request, self.settings)
            internal_id = self.frontend.new_request_id("grpc")
            traceparent = next((v for k, v in context.invocation_metadata() or () if k == "traceparent"), None)
            wire = convert.to_wire(req, internal_id, self.settings, traceparent)
            gen = await self.frontend.submit(wire, req.stop_strings, req.num_choices)
        except APIError as exc:
            await context.abort(*convert.status_of(exc))  # raises
        request_id = request.request_id or internal_id
        self.running[request_id] = gen
        ended: set[int] = set()  # choices whose final update went out
        try:
            async for update in gen.updates():
                response = convert.to_response(request_id, update, gen.token_texts)
                if update.finish_reason is not None:
                    ended.add(update.index)
                    if len(ended) == len(gen.choices):  # the call's last response (choices can end in one step)
                        response.usage.CopyFrom(convert.to_usage(gen.usage()))
                yield response
        except APIError as exc:
            await context.abort(*convert.status_of(exc))
        finally:
            self.running.pop(request_id, None)

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        await self._authorize(context)
        gen = self.running.get(request.request_id)
        if gen is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running request {request.request_id!r}")
        else:  # updates() raises it: the Generate call ends with CANCELLED, the engine gets an Abort
            gen.queue.put_nowait(
                RequestError(gen.request_id, convert.ABORTED, "aborted by an Abort call", code="aborted")
            )
        return pb.AbortResponse()

    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        await self._authorize(context)
        await self.frontend.registry.refresh_now()
        models = [
            pb.Model(id=m.name, max_model_len=m.max_model_len, created=int(m.first_seen))
            for m in self.frontend.registry.servable_models()
        ]
        return pb.ListModelsResponse(models=models)

    async def _authorize(self, context: Any) -> None:
        if not self.keys:
            return
        header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
        if not is_authorized(header.encode() if isinstance(header, str) else header, self.keys):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "incorrect or missing API key (metadata 'authorization: Bearer <key>')"
            )


class GrpcFrontDoor:
    def __init__(self, server: Any, health: Any) -> None:
        self.server, self.health = server, health

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()  # NOT_SERVING while in-flight calls finish
        await self.server.stop(_SHUTDOWN_GRACE_S)


async def start(frontend: Frontend, settings: GatewayConfig) -> GrpcFrontDoor:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", settings.max_body_bytes)])
    pb_grpc.add_GenerationServicer_to_server(GenerationService(frontend, settings), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("gRPC front door on %s:%d", settings.host, settings.grpc_port)
    return GrpcFrontDoor(server, health)
