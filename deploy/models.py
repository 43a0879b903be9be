"""ServedModels: which model's replicas a request goes to when Tern on Ray serves several models (one replica
deployment per model), and the answers the ingress gives for all of them at once: the unknown-model 404 and the
merged GET /v1/models.

A request's model is what it names, as a single server reads it: the JSON body's `model`, else the query's `?model=`
(/tokenizer_info), else the id in /v1/models/{id}; naming none (or an empty one) means the first model, which also
serves the UI, the probes and every route that names no model."""
from __future__ import annotations

import json
from urllib.parse import parse_qs

from api.anthropic.errors import PATH_PREFIX as MESSAGES_PATH
from api.anthropic.errors import error_body as anthropic_error_body
from api.auth import authorize
from api.errors import OpenAIError
from api.route_context import OPEN_PATHS

MODELS_PATH = "/v1/models"


class UnknownModel(Exception):
    """A request named a model no deployment serves; `error` is the answer (a 401 first, without the key)."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


class ServedModels:
    def __init__(self, model_ids: list[str], api_key: str | None = None) -> None:
        self.ids = list(model_ids)
        self.default_id = self.ids[0]
        self.api_key = api_key or None

    @property
    def is_several(self) -> bool:
        return len(self.ids) > 1

    def model_of(self, scope: dict, body: bytes) -> str:
        """The id of the model whose replicas answer this request; raises UnknownModel for an id not served."""
        named = _named_model(scope, body)
        if not named:
            return self.default_id
        if named in self.ids:
            return named
        raise UnknownModel(self._unknown(scope, named))

    def _unknown(self, scope: dict, named: str) -> OpenAIError:
        # Without the key a caller learns nothing, not even which models are served: the replicas' own 401.
        if self.api_key and scope["path"] not in OPEN_PATHS:
            from starlette.requests import Request

            try:
                authorize(Request(scope), self.api_key, takes_x_api_key=is_messages_path(scope["path"]))
            except OpenAIError as refused:
                return refused
        served = ", ".join(f"`{model_id}`" for model_id in self.ids)
        return OpenAIError(404, f"The model `{named}` does not exist. This server serves {served}.", param="model",
                           code="model_not_found")


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_json(path: str, error: OpenAIError) -> bytes:
    """The error in the shape the path's clients read: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    return json.dumps(anthropic_error_body(error) if is_messages_path(path) else error.body()).encode()


def merge_model_lists(bodies: list[bytes]) -> bytes:
    """Each model's GET /v1/models answer (a list of its one card) -> one list of every card, in serving order."""
    cards = [card for body in bodies for card in json.loads(body)["data"]]
    return json.dumps({"object": "list", "data": cards}).encode()


def _named_model(scope: dict, body: bytes) -> str | None:
    path = scope["path"]
    if path.startswith(MODELS_PATH + "/"):
        return path[len(MODELS_PATH) + 1:]
    if body:
        try:
            payload = json.loads(body)
        except ValueError:  # not JSON: the replica's to refuse (a 400 in the API's shape)
            payload = None
        if isinstance(payload, dict) and isinstance(payload.get("model"), str):
            return payload["model"]
    query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model")
    return query[0] if query else None
