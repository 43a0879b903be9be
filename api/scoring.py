"""POST /v1/loglikelihood: how likely each continuation is after its prompt (the contract the UI's Score tab uses)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine import ContinuationScore, Engine, EngineError

from api.errors import OpenAIError
from api.generation import until_disconnected
from api.protocol import MAX_PROMPTS
from api.bodies import ERRORS
from api.route_context import RouteContext

# The engine's names for the two sides of a pair, and ours.
_PARAMS = {"prompt": "prompts", "continuation": "continuations"}


class LoglikelihoodRequest(BaseModel):
    # Strict types, as api.protocol's bodies; the example is what /docs shows and the fuzz tests start from.
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"prompts": ["The capital of France is", "The capital of France is"], "continuations": [" Paris", " London"]},
    ]})
    model: str | None = None
    prompts: list[str | list[int]] = Field(
        min_length=1, max_length=MAX_PROMPTS, description=f"Contexts: text or token ids; at most {MAX_PROMPTS}."
    )
    continuations: list[str | list[int]] = Field(
        min_length=1, max_length=MAX_PROMPTS, description="One per prompt (paired element-wise): text or token ids."
    )


class LoglikelihoodResponse(BaseModel):
    ll: list[float] = Field(description="Summed log-probability of each continuation given its prompt.")
    is_greedy: list[bool] = Field(description="Whether greedy decoding would have produced the continuation.")
    tokens: list[list[int]] = Field(description="Each continuation's token ids (their count is len()).")


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.post(
        "/v1/loglikelihood",
        response_model=LoglikelihoodResponse,
        responses=ERRORS,
        summary="Score continuations",
        description="Text is tokenized as lm-evaluation-harness does: the prompt alone, then prompt + continuation "
        "(a prompt's trailing whitespace moves into the continuation); token ids are used as given.",
    )
    async def loglikelihood(body: LoglikelihoodRequest, request: Request) -> LoglikelihoodResponse:
        engine = (await context.serve(body.model)).engine
        if len(body.prompts) != len(body.continuations):
            message = f"got {len(body.prompts)} prompts but {len(body.continuations)} continuations; pair them one to one"
            raise OpenAIError(400, message, param="continuations")
        scores = await until_disconnected(request, _score(engine, body.prompts, body.continuations))
        return LoglikelihoodResponse(
            ll=[s.logprob for s in scores], is_greedy=[s.is_greedy for s in scores], tokens=[s.token_ids for s in scores]
        )


async def _score(engine: Engine, prompts: list, continuations: list) -> list[ContinuationScore]:
    """All pairs at once (the engine batches them); the first failure cancels the rest, aborting them."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(engine.score(p, [c])) for p, c in zip(prompts, continuations)]
    except BaseExceptionGroup as group:
        error = group.exceptions[0]
        if isinstance(error, EngineError) and error.param in _PARAMS:
            error.param = _PARAMS[error.param]
        raise error from None
    return [task.result()[0] for task in tasks]
