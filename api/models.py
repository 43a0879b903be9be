"""GET /v1/models and /v1/models/{id}, plus the model's status: /health, /ready and /metrics."""
from __future__ import annotations

from fastapi import APIRouter, Response

from api.errors import OpenAIError, shutting_down
from api.metrics import CONTENT_TYPE
from api.bodies import ERRORS, ModelCard, ModelList
from api.route_context import RouteContext


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.get("/v1/models", response_model=ModelList, responses=ERRORS, summary="List the served model")
    async def list_models() -> ModelList:
        return ModelList(data=[_card(context)])

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS, summary="Describe a model")
    async def retrieve_model(model_id: str) -> ModelCard:
        card = _card(context)
        if model_id != card.id:
            message = f"The model `{model_id}` does not exist. This server serves `{card.id}`."
            raise OpenAIError(404, message, param="model", code="model_not_found")
        return card


def add_status_routes(router: APIRouter, context: RouteContext) -> None:
    # /healthz and /readyz: the names Kubernetes probes and many deploy templates use.
    @router.get("/health", responses=ERRORS, summary="200 once the model is loaded, 503 before")
    @router.get("/healthz", responses=ERRORS, summary="The same as /health")
    async def health() -> dict:
        engine = context.engine()
        # Alive while it drains (a liveness probe must not kill it mid-drain); /ready says to send nothing new.
        status = "draining" if context.is_draining else "ok"
        return {"status": status, "model": context.model_name, "device": str(engine.device)}

    @router.get("/ready", responses=ERRORS, summary="200 when new requests would be queued, else 503 (full, draining)")
    @router.get("/readyz", responses=ERRORS, summary="The same as /ready")
    async def ready() -> dict:
        """For load balancers: loaded, and the waiting queue has room (else a request would get a 429)."""
        if context.is_draining:
            raise shutting_down()
        engine = context.engine()
        stats = engine.stats()
        if stats.num_waiting >= engine.info().max_waiting:
            raise OpenAIError(503, "the waiting queue is full", "service_unavailable_error", code="queue_full")
        return {"ready": True, "num_running": stats.num_running, "num_waiting": stats.num_waiting}

    @router.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}},
        summary="Prometheus metrics",
    )
    async def metrics() -> Response:
        return Response(context.metrics.render(), media_type=CONTENT_TYPE)


def _card(context: RouteContext) -> ModelCard:
    info = context.engine().info()
    return ModelCard(
        id=context.model_name,
        created=context.created,
        owned_by="tern",
        max_model_len=info.max_model_len,
        dtype=info.dtype,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        compiled_decode=info.compiled_decode,
        decode_step=info.decode_step,
        cpu_kernels=info.cpu_kernels,
        weight_ratio_to_bf16=info.weight_ratio_to_bf16,
    )
