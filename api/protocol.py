"""Request bodies with OpenAI's field names and ranges; to_sampling_params() is where they become engine names."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import SamplingParams
from engine.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

from api.errors import OpenAIError

MAX_N = 16  # samples per prompt; more would crowd out other users' sequences in one batch
MAX_PROMPTS = 128  # prompts in one /v1/completions or /v1/loglikelihood request: a batch, not a queue of its own


class _Body(BaseModel):
    # Clients send fields we do not know (OpenAI adds them often): ignore them rather than refuse the request.
    # Strict types, as OpenAI's: `true` is no token id nor `"5"` a max_tokens (lax pydantic would take 1 and 5).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="Send a last chunk with `choices: []` and the usage.")


class SamplingRequest(_Body):
    """Fields /v1/chat/completions and /v1/completions share."""

    model: str | None = Field(None, description="The served model id (GET /v1/models); defaults to it.")
    n: int | None = Field(1, ge=1, le=MAX_N, description=f"Samples per prompt, 1 to {MAX_N}.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass; default 1 (off).")
    stop: str | list[str] | None = Field(
        None,
        description=f"Strings that end the text; they are not returned. At most {MAX_STOP_STRINGS}, each at most "
        f"{MAX_STOP_LENGTH} characters.",
    )
    stream: bool | None = Field(False, description="Answer with server-sent events, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Makes sampling reproducible.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description=f"Token id (as a string) -> bias, -100 to 100; at most {MAX_LOGIT_BIAS} entries."
    )
    user: str | None = Field(None, description="Accepted for compatibility; unused.")
    # Extensions, with vLLM's names.
    top_k: int | None = Field(None, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1 = off.")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension: drop tokens below min_p x the top one.")
    repetition_penalty: float | None = Field(None, gt=0, description="Extension: > 1 discourages repeats.")
    min_tokens: int | None = Field(0, ge=0, description="Extension: no EOS or stop token before this many tokens.")
    ignore_eos: bool | None = Field(False, description="Extension: keep going past the end-of-sequence token.")
    stop_token_ids: list[int] | None = Field(
        None, description=f"Extension: token ids that end the text, at most {MAX_STOP_TOKEN_IDS}."
    )
    response_format: dict[str, Any] | None = Field(
        None, description="{\"type\": \"text\"} (default), {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
        "\"json_schema\": {\"name\", \"schema\", \"strict\"}}: the output is held to it token by token "
        "(api/response_format.py; on /v1/completions an extension, as in vLLM).")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None):
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            n=self.n or 1,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._token_bias(),
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _token_bias(self) -> dict[int, float]:
        try:
            return {int(token_id): bias for token_id, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise OpenAIError(400, "logit_bias keys must be token ids, such as \"50256\"", param="logit_bias") from None


class ContentPart(_Body):
    type: str = Field(description="Only \"text\" is supported.")
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str = Field(description="The arguments as JSON text, as the model wrote them.")


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls, sent back as history.")
    tool_call_id: str | None = Field(None, description="On a `tool` message: the call it answers.")
    reasoning_content: str | None = Field(
        None, description="An assistant's reasoning, sent back as history: the chat template decides what to do with it "
        "(Qwen3's keeps only the reasoning after the last user turn).")


class FunctionDefinition(_Body):
    name: str = Field(description="a-z, A-Z, 0-9, _ and -, at most 64 characters.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments object; absent: none.")
    strict: bool | None = Field(None, description="Accepted; the arguments are held to the schema either way.")


class ChatTool(_Body):
    type: str = Field(description="Only \"function\" is supported.")
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: str = Field(description="\"function\"")
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Name three birds."}], "max_tokens": 64},
        {"messages": [{"role": "user", "content": "Name three birds."}], "temperature": 0, "stream": True},
    ]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI for max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: up to the end of the context.")
    logprobs: bool | None = Field(False, description="Return each output token's logprob.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token, 0 to 20.")
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call (api/function_tools.py).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: \"auto\" with tools, else \"none\". \"required\" and a named function hold the "
        "reply to valid calls by a grammar.")
    parallel_tool_calls: bool | None = Field(None, description="Default true: more than one call in a reply.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension (vLLM's, llama-server's): more variables for the chat template, e.g. "
        "{\"enable_thinking\": false} to turn a Qwen3 model's thinking off.")

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0},
        {"prompt": "The capital of France is Paris", "max_tokens": 0, "echo": True, "logprobs": 1},
    ]})
    prompt: list[list[int]] | list[int] | list[str] | str = Field(
        description="A string, a list of strings, a list of token ids (used exactly: no BOS is added), or a list "
        f"of such lists. Several prompts (at most {MAX_PROMPTS}) give choices indexed prompt_index * n + sample_index."
    )
    # OpenAI's default is 16; the issue this server answers asks for "up to the context", like chat (and vLLM's
    # chat). lm-evaluation-harness always sends max_tokens, so it is not affected.
    max_tokens: int | None = Field(
        None, ge=0, description="Default (or null): up to the end of the context. 0 with echo scores the prompt only."
    )
    echo: bool | None = Field(False, description="Return the prompt in front of the completion.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Logprobs of each token plus this many alternatives (0 to 20)."
    )
    suffix: str | None = Field(
        None, description="Text that comes after the completion (fill-in-the-middle): only for models whose vocabulary "
        "has FIM tokens (<fim_prefix>... or <|fim_prefix|>...); not with echo.")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Accepted only when equal to n.")

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != (self.n or 1):
            message = "best_of is not supported unless it equals n"
            raise OpenAIError(400, message, param="best_of", code="unsupported_parameter")
        # echo + logprobs scores the prompt too (lm-evaluation-harness's log-likelihood request).
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        if len(prompt) > MAX_PROMPTS:
            message = f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}; send the rest in another request"
            raise OpenAIError(400, message, param="prompt", code="invalid_value")
        return list(prompt)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the engine renders them (engine/text/tokens.py render_chat): text content only; `developer` is a
    system prompt; an assistant's tool_calls and a tool's tool_call_id kept in OpenAI's shape."""
    rendered = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": _text(message.content, f"messages[{i}].content")}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise OpenAIError(400, "only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.role == "tool":
            if not message.tool_call_id:
                message_text = "a tool message needs the tool_call_id of the call it answers"
                raise OpenAIError(400, message_text, param=f"messages[{i}].tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None and message.role == "assistant":
            entry["reasoning_content"] = message.reasoning_content
        rendered.append(entry)
    return rendered


def _text(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            message = f"content parts of type {part.type!r} are not supported; send text parts"
            raise OpenAIError(400, message, param=f"{param}[{j}]", code="unsupported_content_type")
        texts.append(part.text)
    return "\n".join(texts)  # as vLLM joins text parts
