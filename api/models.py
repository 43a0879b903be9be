"""GET /v1/models and /v1/models/{id} (every served model and its state), plus the server's status: /health, /ready
and /metrics.

One model: as a single-model server always answered (503 until it has loaded, or with why it failed). Several:
/health and /ready are about the server, not about each model, so an idle model unloaded (or one that failed) never
fails a liveness probe: 503 only while the first model's start-up load runs; then 200, each model's state in the
body. /ready is 503 while draining, or when every loaded model's waiting queue is full."""
from __future__ import annotations

from fastapi import APIRouter, Response

from engine.registry import FAILED, LOADED, LOADING, ModelFailedError, ModelNotReadyError, ModelStatus

from api.errors import OpenAIError, shutting_down
from api.metrics import CONTENT_TYPE
from api.bodies import ERRORS, ModelCard, ModelList
from api.route_context import RouteContext


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.get("/v1/models", response_model=ModelList, responses=ERRORS, summary="List the served models")
    async def list_models() -> ModelList:
        statuses = context.models.statuses()
        if len(statuses) == 1:
            _raise_unless_loaded(statuses[0])
        return ModelList(data=[_card(context, status) for status in statuses])

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS, summary="Describe a model")
    async def retrieve_model(model_id: str) -> ModelCard:
        if not model_id:  # resolve() would take it for the default model
            raise OpenAIError(404, "The model `` does not exist.", param="model", code="model_not_found")
        status = context.models.status(model_id)  # an unknown id: a 404 naming the served ones
        if len(context.models.ids) == 1:
            _raise_unless_loaded(status)
        return _card(context, status)


def add_status_routes(router: APIRouter, context: RouteContext) -> None:
    # /healthz and /readyz: the names Kubernetes probes and many deploy templates use.
    @router.get("/health", responses=ERRORS, summary="200 once the first model is loaded, 503 before")
    @router.get("/healthz", responses=ERRORS, summary="The same as /health")
    async def health() -> dict:
        statuses = context.models.statuses()
        first = statuses[0]
        if len(statuses) == 1:
            _raise_unless_loaded(first)
        elif first.state == LOADING and first.num_loads == 0:
            _raise_unless_loaded(first)
        # Alive while it drains (a liveness probe must not kill it mid-drain); /ready says to send nothing new.
        status = "draining" if context.is_draining else "ok"
        body = {"status": status, "model": first.id, "device": _device(context, first.id)}
        if len(statuses) > 1:
            body["models"] = {s.id: s.state for s in statuses}
        return body

    @router.get("/ready", responses=ERRORS, summary="200 when new requests would be queued, else 503 (full, draining)")
    @router.get("/readyz", responses=ERRORS, summary="The same as /ready")
    async def ready() -> dict:
        """For load balancers: the first model has loaded, and a waiting queue has room (else a request would get a
        429)."""
        if context.is_draining:
            raise shutting_down()
        statuses = context.models.statuses()
        if len(statuses) == 1 or (statuses[0].state == LOADING and statuses[0].num_loads == 0):
            _raise_unless_loaded(statuses[0])
        engines = [e for e in (context.models.handle(s.id).engine for s in statuses) if e is not None]
        stats = [engine.stats() for engine in engines]
        if engines and all(s.num_waiting >= e.info().max_waiting for s, e in zip(stats, engines)):
            raise OpenAIError(503, "the waiting queue is full", "service_unavailable_error", code="queue_full")
        return {"ready": True, "num_running": sum(s.num_running for s in stats),
                "num_waiting": sum(s.num_waiting for s in stats)}

    @router.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}},
        summary="Prometheus metrics",
    )
    async def metrics() -> Response:
        return Response(context.metrics.render(), media_type=CONTENT_TYPE)


def _raise_unless_loaded(status: ModelStatus) -> None:
    """What a request for the model gets while it is not loaded: a 503 saying it is loading, or why it failed."""
    if status.state == FAILED:
        raise ModelFailedError(f"model `{status.id}` failed to load: {status.error}", "model")
    if status.state != LOADED:
        raise ModelNotReadyError(f"model `{status.id}` is still loading; retry shortly", "model")


def _device(context: RouteContext, model_id: str) -> str:
    engine = context.models.handle(model_id).engine
    return str(engine.device) if engine is not None else context.models.spec(model_id).config.device


def _card(context: RouteContext, status: ModelStatus) -> ModelCard:
    card = ModelCard(id=status.id, created=context.created, owned_by="tern", state=status.state, error=status.error)
    engine = context.models.handle(status.id).engine
    if status.state != LOADED or engine is None:
        return card
    info = engine.info()
    return card.model_copy(update=dict(
        max_model_len=info.max_model_len,
        dtype=info.dtype,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        compiled_decode=info.compiled_decode,
        decode_step=info.decode_step,
        cpu_kernels=info.cpu_kernels,
        weight_ratio_to_bf16=info.weight_ratio_to_bf16,
        kv_cache_bytes=info.kv_cache_bytes,
        kv_cache_dtype=info.kv_cache_dtype,
        kv_cache_resident=info.kv_cache_resident,
        weights_settled=info.weights_settled,
    ))
