"""The URL-agnostic OpenAI adapter: a request body in, engine work out, a response body back.

    serving = OpenAIServing(model, ServingOptions(OpenAIOptions(tool_parser="hermes")))
    prepared = serving.prepare("/v1/chat/completions", body)   # RequestError on a bad request
    for prompt in prepared.prompts:                             # one engine request each
        engine.add_request(..., prompt, prepared.params)
    body = prepared.finalize(outputs)                           # chat.completion / text_completion
    # or, streaming: chunks = prepared.chunks(); chunks.start(); chunks.update(out); chunks.end()

Both the batch runner and the HTTP server use it; neither needs to know about templates,
parsers or grammars.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from batchrun.engine import structured as engine_structured
from batchrun.engine.pooling import PoolingParams
from batchrun.engine.sampling_params import GrammarSpec, SamplingParams
from batchrun.openai.chat import ChatFormatter
from batchrun.openai.completions import CompletionFormatter
from batchrun.openai.embeddings import EmbeddingFormatter, resolve_pooling
from batchrun.openai.grammar_checks import check_tool_schema, grammar_param
from batchrun.openai.images import has_images, render_with_images
from batchrun.openai.logprobs import TokenText
from batchrun.openai.media import MediaFetcher
from batchrun.openai.params import check_model_field, to_sampling_params
from batchrun.openai.parsers import ToolParser, choose_parsers
from batchrun.openai.parsers.first_call import FirstCallOnly
from batchrun.openai.prepared import PreparedRequest
from batchrun.models.config.classifier import ClassifierHead
from batchrun.openai.pooling_requests import ClassifyRequest, RerankRequest, ScoreRequest
from batchrun.openai.pooling_tasks import (model_head, pair_prompt, prepare_classify,
                                           prepare_scoring)
from batchrun.openai.wire import RequestError, parse_body
from batchrun.openai.requests import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from batchrun.openai.requests import MAX_EMBEDDING_REQUEST_TOKENS
from batchrun.openai.responses import prepare_response
from batchrun.openai.responses_request import ResponsesRequest
from batchrun.openai.render import (load_chat_template, render_prompt, request_template_kwargs,
                                    tokenize_prompt)
from batchrun.openai.structured import (after_reasoning, check_satisfiable, completes,
                                        in_output_format, response_format_grammar,
                                        tool_choice_grammar)
from batchrun.options.openai import OpenAIOptions, RequestDefaults
from batchrun.served_model import ServedModel


@dataclass(frozen=True)
class ServingOptions:
    """What the adapter works with: the user's OpenAI options and request defaults, with the
    chat template and score template files read (`chat_template`, `score_template`: their
    text)."""

    openai: OpenAIOptions = field(default_factory=OpenAIOptions)
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    chat_template: str | None = None
    # open_url(url) -> binary stream: how image parts' fsspec URLs (s3://, gs://, ...) are read,
    # with the job's storage options; None: such URLs are refused.
    open_url: Callable[[str], Any] | None = None
    score_template: str | None = None

    @classmethod
    def of(cls, openai: OpenAIOptions, defaults: RequestDefaults | None = None,
           open_url: Callable[[str], Any] | None = None) -> "ServingOptions":
        template = load_chat_template(openai.chat_template) if openai.chat_template else None
        score = load_chat_template(openai.score_template) if openai.score_template else None
        return cls(openai, defaults or RequestDefaults(), template, open_url, score)

    @property
    def tool_parser(self) -> str | None:
        return self.openai.tool_parser

    @property
    def reasoning_parser(self) -> str | None:
        return self.openai.reasoning_parser

    @property
    def ignore_model_field(self) -> bool:
        return self.openai.ignore_model_field


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.text or "" for p in content if p.type == "text")
    return content or ""


class OpenAIServing:
    def __init__(self, model: ServedModel, options: ServingOptions = ServingOptions()):
        self.model = model
        self.options = options
        self.tokenizer = model.tokenizer
        self.texts = TokenText(self.tokenizer)
        template = options.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        self.tool_parser: ToolParser | None
        self.tool_parser, self.reasoning = choose_parsers(
            options.tool_parser, options.reasoning_parser, template, _model_type(model.path))
        try:
            self.vocab_size: int | None = len(self.tokenizer)
        except TypeError:
            self.vocab_size = None
        self.system_fingerprint = model.fingerprint
        self._grammar_error: str | None = None  # None = not checked yet, "" = fine
        self._ll: Any = None  # llguidance's tokenizer, once a grammar is asked for
        self._eos: set[int] = set()
        self._satisfiable: set[tuple] = set()  # grammars known to admit an output
        self._pooling: PoolingParams | None = None  # read on the first embedding request
        # A vision-language model's processor renders chats with images, fetched by `media`.
        self.processor = model.processor
        self.media = MediaFetcher(options.openai, options.open_url) \
            if self.processor is not None else None
        if options.openai.score_tokens is not None:
            _ = self.head  # a token that is not one, or a model with a head: refused now

    def prepare(self, url: str, body: Any, *, allow_stream: bool = True) -> PreparedRequest:
        """Validate and prepare one request; RequestError (with status and param) if it is bad."""
        request = parse_body(url, body)
        if request.stream and not allow_stream:
            raise RequestError("stream: streaming is not available in a batch file",
                               code="unsupported_value", param="stream")
        adapter = check_model_field(request.model, self.model.name, self.model.aliases,
                                    self.options.ignore_model_field, self.model.adapters)
        if self.head is not None and not self.head.token_ids and isinstance(
                request, (ResponsesRequest, ChatCompletionRequest, CompletionRequest)):
            raise RequestError(
                f"model: {self.model.name!r} is a sequence-classification model: it serves "
                f"/v1/classify, /v1/score, /v1/rerank and /v1/embeddings, not {url}",
                code="unsupported_task", param="model")
        if isinstance(request, ResponsesRequest):
            thinks = self.reasoning or (self.tool_parser if self.tool_parser is not None and
                                        self.tool_parser.splits_reasoning else None)
            return prepare_response(request, functools.partial(self._chat, adapter=adapter),
                                    thinks)
        if isinstance(request, ChatCompletionRequest):
            return self._chat(request, adapter)
        if isinstance(request, EmbeddingRequest):
            return self._embedding(request, adapter)
        if isinstance(request, (ClassifyRequest, ScoreRequest, RerankRequest)):
            return self._pooled(url, request, adapter)
        return self._completion(request, adapter)

    @property
    def pooling(self) -> PoolingParams:
        """--pooling / --normalize, else the model folder's sentence-transformers config."""
        if self._pooling is None:
            opts = self.options.openai
            self._pooling = resolve_pooling(opts.pooling, opts.normalize, self.model.path)
        return self._pooling

    @functools.cached_property
    def head(self) -> ClassifierHead | None:
        """A sequence classifier's head (labels, padding) from the model folder's config, or
        --score-tokens' head over a causal LM's logits; None: no head."""
        return model_head(self.model.path, self.tokenizer, self.options.openai.score_tokens,
                          self.model.name)

    def _pair_prompt(self, query: str, document: str) -> list[int]:
        return pair_prompt(self.tokenizer, self.options.score_template, query, document)

    def _check_grammar_support(self) -> None:
        if self._grammar_error is None:
            eos = sorted(self.model.eos_token_ids or
                         [getattr(self.tokenizer, "eos_token_id", None) or 0])
            try:
                self._ll = engine_structured.ll_tokenizer(self.tokenizer, eos)
                self._eos = set(eos)
                self._grammar_error = ""
            except Exception as exc:  # a slow or unusual tokenizer llguidance cannot read
                self._grammar_error = f"{type(exc).__name__}: {exc}"
        if self._grammar_error:
            raise RequestError("response_format/tool_choice: constrained decoding is not "
                               f"available for this model's tokenizer ({self._grammar_error})",
                               code="unsupported_value", param="response_format")

    def _check_satisfiable(self, grammar: GrammarSpec | None, param: str, what: str) -> None:
        if grammar is None:
            return
        self._check_grammar_support()
        key = (param, grammar.json_schema if isinstance(grammar.json_schema, str) else
               json.dumps(grammar.json_schema, sort_keys=True), grammar.lark, grammar.regex)
        if key not in self._satisfiable:  # a batch's lines mostly share their schema
            check_satisfiable(grammar, self._ll, param, what)
            if len(self._satisfiable) >= 1024:
                self._satisfiable.clear()
            self._satisfiable.add(key)

    def _grammar_check(self, params: SamplingParams):
        """The finish check of PreparedRequest where the output is held to a grammar."""
        if params.grammar is None:
            return None
        spec, ll, eos = params.grammar, self._ll, self._eos
        return lambda token_ids: completes(spec, ll, token_ids, eos)

    def _params(self, request, prompts: list[list[int]], grammar,
                adapter: str | None) -> SamplingParams:
        if grammar is not None:
            self._check_grammar_support()
        longest = max(prompts, key=len)
        params = to_sampling_params(request, len(longest), self.model.max_model_len,
                                    self.model.generation_defaults, self.options.defaults,
                                    vocab_size=self.vocab_size, grammar=grammar)
        params.lora = adapter
        return params

    def _tools(self, request: ChatCompletionRequest):
        """(tools for the template, tool parser, forcing grammar, named) for a chat request."""
        choice = request.tool_choice
        # A parser of the whole output format (Harmony) reads every answer, tools or not.
        whole = self.tool_parser if self.tool_parser and self.tool_parser.always_applies else None
        if not request.tools:
            if choice not in (None, "none"):
                raise RequestError("tool_choice: only allowed when tools are given",
                                   code="invalid_value", param="tool_choice")
            return None, whole, None, False
        for i, tool in enumerate(request.tools):  # a schema a forced call could not use is
            check_tool_schema(tool.function.parameters, i)  # refused whatever the choice
        if choice == "none":
            return None, whole, None, False  # the model is not to call tools: it does not see them
        if self.tool_parser is None:
            raise RequestError(
                "tools: no tool-call parser for this model's chat template; run with "
                "--tool-parser (hermes, llama3_json, mistral, harmony) and a --chat-template "
                "that renders tools", code="tools_not_supported", param="tools")
        tools = [t.model_dump(exclude_none=True) for t in request.tools]
        parallel = request.parallel_tool_calls is not False
        grammar = tool_choice_grammar(self.tool_parser, tools, choice, parallel, self.tokenizer)
        if grammar is not None and request.response_format and \
                request.response_format.type != "text":
            raise RequestError("response_format: cannot be combined with a forced tool_choice",
                               code="invalid_value", param="response_format")
        named = choice not in (None, "auto", "required")
        return tools, self.tool_parser, grammar, named

    def _chat(self, request: ChatCompletionRequest, adapter: str | None = None) -> PreparedRequest:
        tools, parser, tool_grammar, named = self._tools(request)
        multimodal = None
        if self.media is not None and has_images(request.messages):
            prompt, multimodal = render_with_images(
                self.processor, request.messages, self.media, tools=tools,
                chat_template=self.options.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request_template_kwargs(request))
        else:
            prompt = render_prompt(
                self.tokenizer, request.messages, tools=tools,
                chat_template=self.options.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request_template_kwargs(request))
        grammar = tool_grammar or response_format_grammar(request.response_format)
        self._check_satisfiable(grammar, *grammar_param(request, tool_grammar))
        if grammar is not None and self.reasoning is not None:
            grammar = after_reasoning(grammar, self.reasoning)
        elif grammar is not None and tool_grammar is None and parser is not None:
            grammar = in_output_format(grammar, parser, self.tokenizer)
        params = self._params(request, [prompt], grammar, adapter)
        if parser is not None and parser.needs_special_tokens:
            params.skip_special_tokens = False
        if parser is not None and request.parallel_tool_calls is False:
            parser = FirstCallOnly(parser)
        last = request.messages[-1]
        echo = _text(last.content) if request.echo and last.role == "assistant" else ""
        fmt = ChatFormatter(
            adapter or self.model.name, self.tokenizer, self.texts, reasoning=self.reasoning, tools=parser,
            named_tool=named, echo=echo,
            top_logprobs=params.logprobs, system_fingerprint=self.system_fingerprint,
            skip_special_tokens=params.skip_special_tokens,
            prompt_logprobs=request.prompt_logprobs)
        return PreparedRequest("chat", request, [prompt], params, fmt,
                               self._grammar_check(params), multimodal)

    def _completion(self, request: CompletionRequest, adapter: str | None) -> PreparedRequest:
        if request.suffix:
            raise RequestError("suffix: not supported (no fill-in-the-middle)",
                               code="unsupported_value", param="suffix")
        prompt = request.prompt
        texts = None  # the prompts as text, for echo
        if isinstance(prompt, str):
            texts = [prompt]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)
        prompts = self._token_prompts(prompt, "prompt")
        grammar = response_format_grammar(request.response_format)
        self._check_satisfiable(grammar, *grammar_param(request, None))
        params = self._params(request, prompts, grammar, adapter)
        echo = None
        if request.echo:
            echo = texts or [self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        fmt = CompletionFormatter(adapter or self.model.name, self.texts, params.n, params.logprobs,
                                  self.system_fingerprint, echo=echo,
                                  prompt_logprobs=request.prompt_logprobs)
        return PreparedRequest("completion", request, prompts, params, fmt,
                               self._grammar_check(params))

    def _token_prompts(self, value, field: str) -> list[list[int]]:
        """A completions `prompt` or embeddings `input` (string, strings, ids, id lists) as
        token id lists; RequestError naming `field` for an empty one or an id outside the
        vocabulary."""
        if isinstance(value, str):
            prompts = [tokenize_prompt(self.tokenizer, value)]
        elif value and isinstance(value[0], str):
            prompts = [tokenize_prompt(self.tokenizer, p) for p in value]
        elif value and isinstance(value[0], list):
            prompts = [list(p) for p in value]
        else:
            prompts = [list(value)]
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError(f"{field}: {field} {i} is empty", code="invalid_value",
                                   param=field)
            if self.vocab_size is not None and any(t < 0 or t >= self.vocab_size for t in ids):
                raise RequestError(f"{field}: {field} {i} has a token id outside the vocabulary",
                                   code="invalid_value", param=field)
        return prompts

    def _check_inputs(self, prompts: list[list[int]], field: str) -> None:
        """Each pooled input within the context, and all of them within one request's total."""
        limit = self.model.max_model_len
        for i, ids in enumerate(prompts):
            if len(ids) > limit:
                raise RequestError(
                    f"This model's maximum context length is {limit} tokens, however input {i} "
                    f"has {len(ids)} tokens. Please reduce the length of the input.",
                    code="context_length_exceeded", param=field)
        total = sum(map(len, prompts))
        if total > MAX_EMBEDDING_REQUEST_TOKENS:
            raise RequestError(
                f"{field}: at most {MAX_EMBEDDING_REQUEST_TOKENS} tokens summed over all inputs "
                f"of one request, got {total}", code="max_tokens_per_request", param=field)

    def _pooled_inputs(self, request: EmbeddingRequest | ClassifyRequest
                       ) -> tuple[list[list[int]], str]:
        """(token ids, the field they came from) of a pooled request's `input`, or of its
        `messages` rendered with the chat template (vLLM's chat form: one input)."""
        if request.messages is None:
            return self._token_prompts(request.input, "input"), "input"
        if has_images(request.messages):
            raise RequestError("messages: images are not supported in a pooled request",
                               code="unsupported_value", param="messages")
        prompt = render_prompt(
            self.tokenizer, request.messages, chat_template=self.options.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs)
        return [prompt], "messages"

    def _embedding(self, request: EmbeddingRequest, adapter: str | None) -> PreparedRequest:
        prompts, field = self._pooled_inputs(request)
        self._check_inputs(prompts, field)
        # Unknown (an engine on Ray): a larger `dimensions` gives the whole vector.
        width = self.model.hidden_size
        if request.dimensions is not None and width is not None and request.dimensions > width:
            raise RequestError(f"dimensions: this model's embeddings have {width} dimensions, "
                               f"got {request.dimensions}", code="invalid_value",
                               param="dimensions")
        pooling = self.pooling
        params = SamplingParams(max_tokens=0, pooling=pooling, lora=adapter)
        fmt = EmbeddingFormatter(adapter or self.model.name, request.encoding_format or "float",
                                 request.dimensions, pooling.normalize)
        return PreparedRequest("embedding", request, prompts, params, fmt)

    def _pooled(self, url: str, request: ClassifyRequest | ScoreRequest | RerankRequest,
                adapter: str | None) -> PreparedRequest:
        """/v1/classify, /v1/score, /v1/rerank (openai/pooling_tasks.py)."""
        if isinstance(request, ClassifyRequest):
            inputs, field = self._pooled_inputs(request)
            prompts, params, fmt = prepare_classify(request, inputs, self.head, self.model.name,
                                                    adapter)
        else:
            field = request.second_field
            prompts, params, fmt = prepare_scoring(
                url, request, self._pair_prompt, self._token_prompts, self.head,
                self.pooling if self.head is None else None, self.model.name, adapter)
        self._check_inputs(prompts, field)
        if isinstance(request, ClassifyRequest):
            return PreparedRequest("classify", request, prompts, params, fmt)
        if isinstance(request, RerankRequest):
            return PreparedRequest("rerank", request, prompts, params, fmt)
        return PreparedRequest("score", request, prompts, params, fmt)


def _model_type(path) -> str | None:
    """config.json's model_type where the model folder is here (a parser is picked by it)."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (TypeError, OSError, ValueError, AttributeError):
        return None
