"""What the HTTP layer binds, enforces and reads: `HttpConfig` for every tidal HTTP front
(`tidal serve` and `tidal router`), `ServerConfig` for the OpenAI server. Fields are `knob`s,
as the engine's are, so their flags (tidal/engine/flags.py) and the tables of
docs/configuration.md come from the same words."""

from __future__ import annotations

import json
import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

from tidal.cluster.launch import parse_pd
from tidal.core.knobs import check_at_least_one, check_choice, knob
from tidal.model.chat_template import CONTENT_FORMATS
from tidal.runtime.core_watch import RestartPolicy
from tidal.server.openai.reasoning import PARSERS as REASONING_PARSERS

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")


@dataclass(frozen=True)
class HttpConfig:
    """Where a tidal HTTP front listens and what it refuses before a request reaches a route
    (the server and the P/D router answer alike)."""

    host: str = knob("127.0.0.1", "Address to bind (loopback unless told otherwise).")
    port: int = knob(8000, "Port to listen on.")
    api_key: str | None = knob(None, "Require `Authorization: Bearer KEY` on /v1/*, "
                               "/tokenize, /detokenize, /dashboard and the API docs (401 "
                               "otherwise). Unset: --api-key-file, else the TIDAL_API_KEY "
                               "environment variable, else none.")
    api_key_file: str | None = knob(None, "A file whose first line is the API key (kept off "
                                    "the command line, which any local user may read).")
    max_body_bytes: int = knob(8 * 1024 * 1024, "Largest request body; larger ones get HTTP "
                               "413.")
    max_header_bytes: int = knob(16 * 1024, "Largest request line plus headers; larger ones "
                                 "get HTTP 431 (h11's own default).")
    idle_timeout: float = knob(5.0, "Seconds a connection may sit idle, before its first "
                               "request or between requests, before it is closed (uvicorn's "
                               "keep-alive default).")
    request_read_timeout: float = knob(30.0, "Seconds a client may take to send one request, "
                                       "headers and body, from its first byte; a slower one "
                                       "is closed (a trickling client holds no connection).")
    health_generate_timeout: float = knob(20.0, "Seconds GET /health_generate waits for its "
                                          "one-token generation; past them it answers 503 "
                                          "unless other requests got tokens meanwhile.")
    max_connections: int | None = knob(None, "Open connections past which new ones are closed "
                                       "at once (unset: the open-file limit less 256, kept for "
                                       "the server's own files and sockets).")
    uds: str | None = knob(None, "Listen on this Unix domain socket's path instead of "
                           "host:port (a proxy on the same machine, no TCP port).")
    ssl_keyfile: str | None = knob(None, "TLS: the server's private key (PEM), with "
                                   "--ssl-certfile: the API is served over https.")
    ssl_certfile: str | None = knob(None, "TLS: the server's certificate chain (PEM).")
    ssl_ca_certs: str | None = knob(None, "TLS: the certificates (PEM) a client's own "
                                    "certificate must be signed by (with --ssl-cert-reqs).")
    ssl_cert_reqs: int = knob(0, "TLS: whether a client must show a certificate signed by "
                              "--ssl-ca-certs: 0 no, 1 if it has one, 2 always (mutual TLS; "
                              "Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED).")
    root_path: str | None = knob(None, "The path prefix a path-routing proxy serves the API "
                                 "under, e.g. /llm (ASGI's root_path): the API docs' links "
                                 "carry it; requests are answered with it or without.")
    allowed_origins: tuple[str, ...] = knob((), "Web origins whose pages may call the API "
                                            "from a browser (CORS), e.g. "
                                            "https://chat.example.com, or * for any. None "
                                            "given: no CORS headers (vLLM allows every "
                                            "origin by default).")
    allowed_methods: tuple[str, ...] = knob(("*",), "With --allowed-origins: the HTTP "
                                            "methods those pages may use.")
    allowed_headers: tuple[str, ...] = knob(("*",), "With --allowed-origins: the request "
                                            "headers those pages may send.")
    allow_credentials: bool = knob(False, "With --allowed-origins: let those pages send "
                                   "cookies and HTTP authentication (never with origin *).")
    uvicorn_log_level: str = knob("info", "uvicorn's log level: critical, error, warning, "
                                  "info, debug or trace.")
    disable_uvicorn_access_log: bool = knob(False, "No access-log line per request.")

    def __post_init__(self) -> None:
        # self.key, the API key in force: not a field, so replace() resolves it anew
        object.__setattr__(self, "key", self._key())
        check_at_least_one(self, "max_body_bytes", "max_header_bytes")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be > 0, got {self.idle_timeout}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"request_read_timeout must be > 0, got "
                             f"{self.request_read_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if not self.health_generate_timeout > 0:
            raise ValueError(f"health_generate_timeout must be > 0, got "
                             f"{self.health_generate_timeout}")
        self._check_front()

    def _check_front(self) -> None:
        """The TLS files, socket path, prefix and CORS settings: a ValueError names the
        option at fault before anything binds."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")
        if self.ssl_ca_certs is not None and self.ssl_keyfile is None:
            raise ValueError("ssl_ca_certs needs TLS: --ssl-keyfile and --ssl-certfile")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2; got {self.ssl_cert_reqs}")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("ssl_cert_reqs needs --ssl-ca-certs: what a client's "
                             "certificate is checked against")
        if self.uds is not None and not os.path.isdir(os.path.dirname(
                os.path.abspath(self.uds))):
            raise ValueError(f"uds {self.uds!r}: its folder does not exist")
        if self.root_path is not None and not re.fullmatch(r"(/[^/\s?#]+)+", self.root_path):
            raise ValueError(f"root_path must look like /prefix (no trailing slash), got "
                             f"{self.root_path!r}")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials does not go with allowed_origins *: name "
                             "the origins")
        check_choice("uvicorn_log_level", self.uvicorn_log_level,
                     ("critical", "error", "warning", "info", "debug", "trace"))

    def connection_cap(self) -> int:
        """max_connections, or the process's open-file limit less 256."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(16, soft - 256) if soft != resource.RLIM_INFINITY else 65536

    def _key(self) -> str | None:
        """The API key: --api-key, else the first line of --api-key-file, else
        TIDAL_API_KEY (vLLM reads VLLM_API_KEY alike), else none."""
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give the API key once: --api-key or --api-key-file, not both")
        key = self.api_key
        if self.api_key_file is not None:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    key = f.readline().strip()
            except OSError as exc:
                raise ValueError(f"api_key_file {self.api_key_file!r}: {exc.strerror}") from exc
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file!r} holds no key on its "
                                 f"first line")
        elif key is None:
            key = os.environ.get("TIDAL_API_KEY") or None
        if key is not None and not key.strip():
            raise ValueError("the API key is empty")
        return key


@dataclass(frozen=True)
class ServerConfig(HttpConfig):
    """What `tidal serve` enforces in front of its engine cores, how it reads replies, and
    how it restarts a core that died."""

    served_model_name: tuple[str, ...] = knob((), "The names clients may send as `model` "
                                              "(unset: the model's own): answers, metrics "
                                              "and the adapters' parent carry the first.")
    max_pending: int = knob(512, "Sequences in flight (each prompt of a request times its "
                            "n) before new requests get HTTP 429.")
    max_sequences_per_request: int = knob(256, "Most sequences one request may ask for, its "
                                          "prompts times n (more: HTTP 400).")
    max_n: int = knob(16, "Largest `n` a request may ask for.")
    drain_timeout: float = knob(30.0, "Seconds SIGTERM lets running requests finish.")
    stream_interval: int = knob(1, "Tokens per chunk of a streamed answer (vLLM's and "
                                "SGLang's): a sequence's first token goes at once, then a "
                                "chunk each time this many more have come, and the rest when "
                                "it ends. Larger: fewer, larger chunks, less work per token "
                                "for the server and the client.")
    enable_log_requests: bool = knob(False, "Log each request as the engine takes it (vLLM's): "
                                     "its id, prompt, token ids, the sampling parameters it "
                                     "set and its adapter, on the tidal.requests logger.")
    enable_log_outputs: bool = knob(False, "With --enable-log-requests: log each sequence's "
                                    "output, token ids and finish reason as it ends.")
    max_log_len: int | None = knob(None, "Characters of a prompt or output, and token ids, "
                                   "a request's log line keeps (unset: all).")
    max_total_tokens: int | None = knob(None, "Most output tokens one prompt may ask for, n x "
                                        "max_tokens (unset: no cap beyond max_n and the "
                                        "context).")
    max_logprobs: int = knob(20, "Most alternatives a request may ask for per token, of its "
                             "output or its prompt (vLLM's; -1: up to the vocabulary).")
    max_constraint_bytes: int = knob(128 * 1024, "Largest output constraint (a JSON schema, "
                                     "regex, choice list or grammar) a request may send; its "
                                     "compilation grows with it.")
    max_stop_strings: int = knob(16, "Most stop strings a request may send (and most "
                                 "bad_words).")
    max_stop_length: int = knob(256, "Most characters of one stop string (a stream holds "
                                "that much text back), or of one bad word.")
    tool_call_parser: str = knob("auto", "How tool_choice 'auto' reads the model's calls: "
                                 "'hermes' (<tool_call> JSON: Qwen, Hermes, and models "
                                 "without a tool template), 'llama3_json', 'mistral' "
                                 "([TOOL_CALLS]; 9-character call ids, as its templates "
                                 "require), 'pythonic' ([f(a=1), g()]: Llama 3.2 and 4's "
                                 "pythonic templates), or 'auto' (from the chat template).")
    reasoning_parser: str | None = knob(None, "Where replies' reasoning goes to "
                                        "reasoning_content: 'think' (also 'qwen3', "
                                        "'deepseek_r1'): <think> blocks; 'mistral': "
                                        "[THINK] blocks (Magistral); 'seed_oss': "
                                        "<seed:think> blocks.")
    chat_template: str | None = knob(None, "A chat template (jinja) in place of the model's "
                                     "own, for every chat, Responses and Messages request and "
                                     "/tokenize: a file's path, or the template itself.")
    trust_request_chat_template: bool = knob(False, "Render a chat request's own "
                                             "`chat_template` (vLLM's field; a sandboxed "
                                             "jinja2 runs it). Without it such a request is "
                                             "refused.")
    chat_template_content_format: str = knob(
        "auto", "How a message's content reaches the chat template (vLLM's): 'string' (text, "
        "text parts joined with newlines), 'openai' (a list of {'type': 'text', 'text': ...} "
        "parts), or 'auto': 'openai' where the template loops over a message's content.")
    default_chat_template_kwargs: str | None = knob(
        None, "A JSON object of chat-template variables every chat renders with, under a "
        "request's own chat_template_kwargs (vLLM's; e.g. '{\"enable_thinking\": false}').")
    response_role: str = knob("assistant", "The role of a chat answer's message where the "
                              "request adds a generation prompt (vLLM's); else the last "
                              "message's own.")
    middleware: tuple[str, ...] = knob((), "ASGI middleware around the app (vLLM's): import "
                                       "paths `module.name` of a class (added as "
                                       "app.add_middleware does) or of an `async def f("
                                       "request, call_next)` HTTP middleware.")
    return_tokens_as_token_ids: bool = knob(False, "Every answer's logprobs name their tokens "
                                            "`token_id:<id>` (vLLM's; a request may ask by "
                                            "its field of the same name).")
    enable_force_include_usage: bool = knob(False, "Every stream ends with its usage, as if "
                                            "stream_options.include_usage were set (vLLM's).")
    disable_fastapi_docs: bool = knob(False, "Serve no /docs, /redoc or /openapi.json "
                                      "(vLLM's).")
    headless: bool = knob(False, "Run only this node's tensor-parallel ranks, for the engine "
                          "core of node 0 (--nnodes, --node-rank > 0): no API, no engine "
                          "core; the ranks are started again whenever node 0 forms a new "
                          "group.")
    enable_lora_runtime_updates: bool = knob(False, "Allow POST /v1/load_lora_adapter and "
                                             "/v1/unload_lora_adapter (vLLM's), behind the "
                                             "API key if there is one.")
    task: str = knob("auto", "What the server answers: 'auto' generation, embeddings and "
                     "(with a score head) scores, 'generate' generation only, 'embed' "
                     "embeddings only (an embedding model, whose generated text means "
                     "nothing), 'score' /v1/score, /v1/rerank and /classify only (a "
                     "reranker or classifier); the "
                     "other endpoints answer 400.")
    otlp_traces_endpoint: str | None = knob(
        None, "An OTLP/HTTP traces URL (e.g. http://localhost:4318/v1/traces): one span per "
        "request, with the GenAI conventions' attributes and the scheduler's events, "
        "continuing a client's traceparent (the opentelemetry SDK: pip install "
        "'tidal[otel]'). Unset: no traces.")
    response_store_bytes: int = knob(256 * 1024 * 1024, "Memory for responses created with "
                                     "`store: true` (the Responses API), the oldest dropped "
                                     "first; 0 keeps none.")
    response_ttl: float = knob(3600.0, "Seconds a stored response is kept.")
    batch_store: str | None = knob(None, "The SQLite file of the Batch API's files and "
                                   "batches (/v1/files, /v1/batches), made on first use; a "
                                   "restart resumes its batches (unset: "
                                   "~/.cache/tidal/batches/<served model name>.sqlite).")
    batch_concurrency: int = knob(8, "Batch API lines in flight at once while no live "
                                  "request is (one while any is).")
    batch_file_days: float = knob(30.0, "Days a file uploaded for a batch, and a batch's "
                                  "output and error files, are kept unless the request "
                                  "sets their expiry (OpenAI's expires_after, "
                                  "output_expires_after); then they are deleted. Other "
                                  "files are kept until deleted. 0: all kept.")
    max_file_bytes: int = knob(200 * 1024 * 1024, "Largest upload to /v1/files (OpenAI's "
                               "batch input limit); other bodies keep max_body_bytes.")
    restart_core: int = knob(3, "Restart a dead engine core up to this many times in a row "
                             "(0: never); its in-flight requests fail, new ones get 503 until "
                             "it is back.")
    restart_backoff: float = knob(1.0, "Seconds before the first restart of a dead core, "
                                  "doubled for each next one.")
    core_hang_timeout: float = knob(10.0, "Seconds an engine core's process may go without "
                                    "a heartbeat (twice a second, from a thread of its own, "
                                    "so a long step is no silence; a stall of the frontend's "
                                    "own loop is not counted) before it counts as hung "
                                    "(e.g. stopped): killed, its requests failed, and "
                                    "restarted like a dead one (0: never).")
    pd: str | None = knob(None, "Prefill/decode disaggregation on this machine, as xPyD (e.g. "
                          "1P1D): start x prefill and y decode instances and serve the "
                          "router on the port.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least_one(self, "max_pending", "max_sequences_per_request", "max_n",
                           "max_constraint_bytes", "max_stop_strings", "max_stop_length",
                           "batch_concurrency", "max_file_bytes")
        if self.batch_file_days < 0:
            raise ValueError(f"batch_file_days must be >= 0, got {self.batch_file_days}")
        check_choice("chat_template_content_format", self.chat_template_content_format,
                     CONTENT_FORMATS)
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be at least 1, got {self.max_total_tokens}")
        check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        check_choice("task", self.task, ("auto", "generate", "embed", "score"))
        if self.core_hang_timeout < 0:
            raise ValueError(f"core_hang_timeout must be >= 0, got {self.core_hang_timeout}")
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, tuple(REASONING_PARSERS))
        if self.response_store_bytes < 0 or self.response_ttl <= 0:
            raise ValueError("response_store_bytes must be >= 0 and response_ttl > 0, got "
                             f"{self.response_store_bytes} and {self.response_ttl}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        names = self.served_model_name
        if any(not n.strip() for n in names) or len(set(names)) != len(names):
            raise ValueError(f"served_model_name takes distinct, non-blank names; got "
                             f"{' '.join(map(repr, names))}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("enable_log_outputs needs --enable-log-requests")
        self.restart_policy()  # its own checks
        self.chat_template_defaults()  # its own checks
        if not self.response_role.strip():
            raise ValueError("response_role must not be blank")
        if self.pd is not None:
            parse_pd(self.pd)

    def chat_template_defaults(self) -> dict:
        """--default-chat-template-kwargs as a dict; ValueError unless a JSON object of
        variables a request could set."""
        from tidal.server.openai.chat import RESERVED_TEMPLATE_ARGS

        if self.default_chat_template_kwargs is None:
            return {}
        try:
            kwargs = json.loads(self.default_chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"default_chat_template_kwargs is not JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("default_chat_template_kwargs must be a JSON object, e.g. "
                             "'{\"enable_thinking\": false}'")
        taken = [k for k in kwargs if k in RESERVED_TEMPLATE_ARGS]
        if taken:
            raise ValueError(f"default_chat_template_kwargs may not set {taken[0]!r}: the "
                             f"server sets it")
        return kwargs

    def middleware_objects(self) -> list:
        """--middleware's classes and functions, imported; ValueError naming one that is
        not there."""
        import importlib

        found = []
        for path in self.middleware:
            module, _, name = path.rpartition(".")
            try:
                found.append(getattr(importlib.import_module(module), name))
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(f"middleware {path!r} does not import: {exc}") from None
        return found

    @property
    def model_name(self) -> str:
        """The served name answers carry: the first of served_model_name."""
        return self.served_model_name[0] if self.served_model_name else "model"

    def batch_store_path(self) -> Path:
        """--batch-store, or the served model's store under ~/.cache/tidal/batches."""
        if self.batch_store is not None:
            return Path(self.batch_store).expanduser()
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model_name)
        return Path.home() / ".cache" / "tidal" / "batches" / f"{name}.sqlite"

    def restart_policy(self) -> RestartPolicy:
        """How the client restarts a dead engine core."""
        return RestartPolicy(self.restart_core, self.restart_backoff,
                             hang_timeout=self.core_hang_timeout)

    @property
    def pd_counts(self) -> tuple[int, int]:
        """(prefill, decode) instances that `pd` asks for."""
        return parse_pd(self.pd or "")
