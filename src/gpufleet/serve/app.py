"""The ASGI app: the KServe v2 / Triton HTTP endpoints on Starlette.

Endpoints (``{model}`` path segments may carry ``/versions/{version}``):

- ``GET /v2/health/live``, ``GET /v2/health/ready``: 200 when live / every model is ready;
- ``GET /v2``: server metadata (name, version, extensions);
- ``GET /v2/models/{name}``: model metadata (inputs and outputs with -1 for any size);
- ``GET /v2/models/{name}/ready``; ``GET /v2/models/{name}/config`` (Triton's model
  config as JSON);
- ``POST /v2/models/{name}/infer``: inference, JSON or with binary tensor data;
- with a model repository (:mod:`gpufleet.serve.repository`), the ``model_repository``
  extension: ``POST /v2/repository/index``, ``POST /v2/repository/models/{name}/load``
  and ``.../unload``;
- ``GET /metrics``: Prometheus text.

Every path answers the same with a trailing slash (the REST spec writes ``/v2/``), every
405 names the allowed methods in ``Allow``, and every JSON body is RFC 8259 JSON (a NaN
or an infinity in a tensor travels as the string ``"NaN"``, ``"Infinity"`` or
``"-Infinity"``). Each request body is checked against the protocol's schema
(:mod:`gpufleet.serve.schema`) before any field is used.

The event loop stays free for health and metadata requests: each model runs in its
batcher's thread, and a large body (over ``PARSE_INLINE_BYTES``) is parsed into arrays in
a separate process (JSON parsing holds the GIL, so a thread would not help). The bytes of
the requests in flight are capped (``max_inflight_bytes``): past the cap a request gets
429 with a Retry-After instead of growing the server's memory. A body is read into one
buffer of its declared length, its number arrays go straight into numpy
(:mod:`gpufleet.serve.jsonnum`), and after a large request the freed heap is handed back
to the operating system (:mod:`gpufleet.serve.trim`). Every error a client can
cause is a 4xx with ``{"error": "..."}``; a client that disconnects mid-request is one
log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gpufleet.errors import unknown_choice
from gpufleet.serve.batcher import DynamicBatcher, ModelError
from gpufleet.serve.body import Body, InflightBytes, decompress, parse_shared
from gpufleet.serve.metrics import CONTENT_TYPE, ServerMetrics
from gpufleet.serve.model import ServedModel
from gpufleet.serve.protocol import (
    HEADER_LENGTH,
    InferRequest,
    ProtocolError,
    Tensor,
    dump_json,
    encode_infer_response,
    parse_infer_request,
    require,
)
from gpufleet.serve.repository import ModelRepository, free_memory
from gpufleet.serve.schema import LOAD_REQUEST, REPOSITORY_INDEX_REQUEST, UNLOAD_REQUEST, Schema
from gpufleet.serve.signature import check_inputs, wanted_outputs
from gpufleet.serve.trim import fix_mmap_threshold, parse_and_trim, trim_heap

log = logging.getLogger(__name__)

EXTENSIONS = ["binary_tensor_data"]  # and "model_repository" when serving a repository
MAX_CONTROL_BYTES = 64 * 1024  # bodies of the repository requests (index, load, unload)
PARSE_INLINE_BYTES = 256 * 1024  # larger bodies are parsed in another process
TRIM_AFTER_BYTES = 1 * 2**20  # after a larger request the freed heap goes back to the OS


@dataclass
class ServeOptions:
    """How the server batches and what it accepts."""

    max_batch_size: int = 8  # most rows per model call; 1 turns batching off
    max_queue_delay_us: int = 1000  # longest the oldest request waits for others to join
    max_body_bytes: int = 64 * 2**20  # larger request bodies get 413
    max_inflight_bytes: int = 256 * 2**20  # bytes of all requests being handled; past: 429
    parse_workers: int = 2  # processes that parse large bodies

    def __post_init__(self) -> None:
        for key in ("max_batch_size", "max_body_bytes", "max_inflight_bytes",
                    "parse_workers"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} = {getattr(self, key)}: must be 1 or more.")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us = {self.max_queue_delay_us}: must be >= 0.")


class StrictJSONResponse(JSONResponse):
    """A JSON response that is always RFC 8259 JSON (no bare NaN or Infinity)."""

    def render(self, content: object) -> bytes:
        return dump_json(content)


def _error(message: str, status: int = 400, headers: Mapping[str, str] | None = None
           ) -> StrictJSONResponse:
    return StrictJSONResponse({"error": message}, status_code=status, headers=headers)


class _Server:
    """The state behind the routes: the models, their batchers, the metrics, and the
    repository the models come from (None: a fixed set of models)."""

    def __init__(self, models: Sequence[ServedModel], options: ServeOptions,
                 repository: ModelRepository | None,
                 unavailable: Mapping[str, str] | None) -> None:
        self.models = {m.name: m for m in models}
        self.options = options
        self.metrics = ServerMetrics()
        self.batchers: dict[str, DynamicBatcher] = {}
        self.inflight = InflightBytes(options.max_inflight_bytes)
        self._parser: ProcessPoolExecutor | None = None  # started by the first large body
        self.repository = repository
        self.unavailable = dict(unavailable or {})  # repository model -> why not loaded
        self._loading = asyncio.Lock()  # one load or unload at a time

    def _batcher(self, m: ServedModel) -> DynamicBatcher:
        return DynamicBatcher(m.fn, self.options.max_batch_size,
                              self.options.max_queue_delay_us / 1e6, name=m.name,
                              metrics=self.metrics)

    def start(self) -> None:
        for name, m in self.models.items():
            self.batchers[name] = self._batcher(m)

    def stop(self) -> None:
        for batcher in self.batchers.values():
            batcher.close()
        self.batchers.clear()
        if self._parser is not None:
            self._parser.shutdown(cancel_futures=True)
            self._parser = None

    async def parse(self, body: Body, header_length: str | None) -> InferRequest:
        """Parse a request body; a large one in the parse processes, off the event loop."""
        if body.shm is None and body.size <= PARSE_INLINE_BYTES:
            return parse_infer_request(body.bytes(), header_length)
        if self._parser is None:
            self._parser = ProcessPoolExecutor(self.options.parse_workers,
                                               mp_context=mp.get_context("spawn"),
                                               initializer=fix_mmap_threshold)
        loop = asyncio.get_running_loop()
        if body.shm is not None:  # the process maps the block: no copy of the body
            return await loop.run_in_executor(self._parser, parse_shared, body.shm.name,
                                              body.size, header_length)
        return await loop.run_in_executor(self._parser, parse_and_trim, body.bytes(),
                                          header_length)

    def model(self, request: Request) -> ServedModel:
        name = request.path_params["name"]
        if name not in self.models:
            if self.repository is not None and name in self.repository.names():
                why = self.unavailable.get(name, "not loaded")
                raise ProtocolError(f"model {name!r} is not loaded ({why}). Load it with "
                                    f"POST /v2/repository/models/{name}/load.")
            known = set(self.models) | set(self.repository.names() if self.repository
                                           else ())
            raise ProtocolError(unknown_choice("model", name, sorted(known)), status=404)
        version = request.path_params.get("version")
        model = self.models[name]
        if version is not None and version != model.version:
            raise ProtocolError(f"model {name!r} has no version {version!r}. Versions: "
                                f"{model.version}.", status=404)
        return model

    # -- routes -------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        ok = self.batchers.keys() == self.models.keys()
        return Response(status_code=200 if ok else 503)

    async def server_metadata(self, request: Request) -> Response:
        from gpufleet import __version__

        extensions = EXTENSIONS + (["model_repository"] if self.repository else [])
        return StrictJSONResponse({"name": "gpufleet", "version": __version__,
                                   "extensions": extensions})

    async def model_metadata(self, request: Request) -> Response:
        m = self.model(request)

        def spec(s):
            return {"name": s.name, "datatype": s.datatype, "shape": [-1, *s.dims]}

        return StrictJSONResponse({"name": m.name, "versions": [m.version],
                                   "platform": m.platform,
                                   "inputs": [spec(s) for s in m.inputs],
                                   "outputs": [spec(s) for s in m.outputs]})

    async def model_ready(self, request: Request) -> Response:
        m = self.model(request)
        return Response(status_code=200 if m.name in self.batchers else 400)

    async def model_config(self, request: Request) -> Response:
        from gpufleet.serve.export import model_config

        m = self.model(request)
        return StrictJSONResponse(model_config(m, self.options.max_batch_size,
                                               self.options.max_queue_delay_us))

    # -- the model_repository extension --------------------------------------------------

    def _repository(self, request: Request) -> ModelRepository:
        if self.repository is None:
            raise ProtocolError(
                f"{request.url.path}: this server serves a fixed set of models "
                f"({', '.join(sorted(self.models))}), not a model repository, so the "
                "model_repository extension is off. Serve a directory of model folders "
                "(gpufleet serve DIR, e.g. what gpufleet export triton writes).", status=404)
        return self.repository

    async def _control_body(self, request: Request, schema: Schema, where: str) -> dict:
        """The small JSON body of a repository request (empty: ``{}``)."""
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_CONTROL_BYTES:
                raise ProtocolError(f"{where} is over {MAX_CONTROL_BYTES} bytes.", status=413)
        if not raw.strip():
            return {}
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ProtocolError(f"{where} is not valid JSON: {e}.") from None
        require(doc, schema, where)
        return doc

    async def repository_index(self, request: Request) -> Response:
        repo = self._repository(request)
        doc = await self._control_body(request, REPOSITORY_INDEX_REQUEST,
                                       "the repository index request")
        entries = []
        for name in sorted(set(repo.names()) | set(self.models)):
            if name in self.batchers:
                entries.append({"name": name, "version": self.models[name].version,
                                "state": "READY", "reason": ""})
            elif not doc.get("ready"):
                entries.append({"name": name, "state": "UNAVAILABLE",
                                "reason": self.unavailable.get(name, "not loaded")})
        return StrictJSONResponse(entries)

    async def load(self, request: Request) -> Response:
        """Load (or reload) a model from its folder; the old one serves until then."""
        repo = self._repository(request)
        name = request.path_params["name"]
        doc = await self._control_body(request, LOAD_REQUEST, "the load request")
        given = [k for k in (doc.get("parameters") or {})
                 if k == "config" or k.startswith("file:")]
        if given:
            raise ProtocolError(f"load parameters {given}: this server loads a model only as "
                                f"its folder in {str(repo.root)!r} holds it. Change the "
                                "files there and load again, without parameters.")
        try:
            repo.folder(name)
        except KeyError as e:
            raise ProtocolError(e.args[0], status=404) from None
        async with self._loading:
            try:  # reads files and runs the model on an example batch: off the event loop
                model = await asyncio.to_thread(repo.load, name)
            except Exception as e:  # whatever the folder holds, the server keeps serving
                if name not in self.batchers:
                    self.unavailable[name] = f"load failed: {type(e).__name__}: {e}"
                raise ProtocolError(f"model {name!r} failed to load from "
                                    f"{str(repo.folder(name))!r}: {type(e).__name__}: {e}"
                                    ) from None
            old = self.batchers.pop(name, None)
            self.models[name], self.batchers[name] = model, self._batcher(model)
            self.unavailable.pop(name, None)
            if old is not None:  # its queued requests finish on the old model
                await asyncio.to_thread(old.close)
        log.info("loaded model %r from the repository", name)
        return Response(status_code=200)

    async def unload(self, request: Request) -> Response:
        """Unload a model: its queued requests finish, then its memory is freed."""
        repo = self._repository(request)
        name = request.path_params["name"]
        await self._control_body(request, UNLOAD_REQUEST, "the unload request")
        if name not in self.models and name not in repo.names():
            raise ProtocolError(unknown_choice("model", name, sorted(
                set(repo.names()) | set(self.models))), status=404)
        async with self._loading:
            batcher = self.batchers.pop(name, None)
            self.models.pop(name, None)
            self.unavailable[name] = "unloaded"
            if batcher is not None:
                await asyncio.to_thread(batcher.close)
                del batcher  # the last reference to the model's function
                await asyncio.to_thread(free_memory)
        log.info("unloaded model %r", name)
        return Response(status_code=200)

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type=CONTENT_TYPE)

    async def infer(self, request: Request) -> Response:
        start = time.perf_counter()
        m = self.model(request)
        self.metrics.requests.inc(m.name)
        held = self.inflight.holder()
        body = Body()
        try:
            return await self._infer(request, m, start, held, body)
        except ClientDisconnect:
            log.info("client %s disconnected before its request to %r was complete",
                     request.client.host if request.client else "?", m.name)
            self.metrics.failures.inc(m.name, "request")
            return Response(status_code=400)  # nobody reads it
        finally:
            large = held.held > TRIM_AFTER_BYTES
            body.release()
            held.release()
            if large:  # the body, its text and arrays are freed: give the heap back
                trim_heap()

    async def _infer(self, request: Request, m: ServedModel, start: float,
                     held: InflightBytes.Holder, body: Body) -> Response:
        try:
            body = await self._read_body(request, held, body)
            req = await self.parse(body, request.headers.get(HEADER_LENGTH))
            body.release()  # parsed: the arrays are all the request holds now
            inputs = check_inputs(m, req, self.options.max_batch_size)
            wanted = wanted_outputs(m, req)
        except ProtocolError:
            self.metrics.failures.inc(m.name, "request")
            raise
        batcher = self.batchers.get(m.name)
        if batcher is None:  # unloaded while this request was read
            self.metrics.failures.inc(m.name, "request")
            raise ProtocolError(f"model {m.name!r} was unloaded while the request was read. "
                                f"Load it again (POST /v2/repository/models/{m.name}/load).")
        try:
            outputs = await batcher.infer(inputs)
        except ModelError as e:
            self.metrics.failures.inc(m.name, "model")
            return _error(f"model {m.name!r} failed on this request: {e}", 400)
        by_name = {s.name: (s, a) for s, a in zip(m.outputs, outputs)}
        chosen = [(Tensor(n, by_name[n][0].datatype, by_name[n][1]), b) for n, b in wanted]
        try:
            payload, header_length = encode_infer_response(m.name, m.version, req.id, chosen)
        except ProtocolError:
            self.metrics.failures.inc(m.name, "request")
            raise
        self.metrics.latency.observe(time.perf_counter() - start, m.name)
        if header_length is None:
            return Response(payload, media_type="application/json")
        return Response(payload, media_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(header_length)})

    async def _read_body(self, request: Request, held: InflightBytes.Holder,
                         body: Body) -> Body:
        """The body, read into ``body`` (or a new one, for a compressed body)."""
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"the request body has {int(declared)} bytes, more than the "
                                f"server's limit of {limit}. Send smaller batches, or start "
                                "the server with a larger --max-body-bytes.", status=413)
        encoding = request.headers.get("content-encoding")
        if declared.isdigit():
            held.hold(int(declared))  # reserved before any byte is read
            size = int(declared)
            body.allocate(size, shared=size > PARSE_INLINE_BYTES and not encoding)
        async for chunk in request.stream():
            if body.size + len(chunk) > limit:
                raise ProtocolError(f"the request body exceeds the server's limit of {limit} "
                                    "bytes. Send smaller batches, or start the server with a "
                                    "larger --max-body-bytes.", status=413)
            held.hold(body.size + len(chunk))
            body.append(chunk)
        if not encoding or encoding == "identity":
            return body
        raw_size = body.size
        data = decompress(body.bytes(), encoding, limit)
        body.release()
        held.hold(len(data) + raw_size)  # both were in memory at once
        return Body(data)

def create_app(models: Sequence[ServedModel], options: ServeOptions | None = None,
               repository: ModelRepository | None = None,
               unavailable: Mapping[str, str] | None = None) -> Starlette:
    """The Starlette app serving ``models`` over the v2 protocol.

    Args:
        models: the models to serve from the start.
        options: batching and limits.
        repository: where ``models`` came from, for the ``model_repository`` extension
            (index, load, unload); None: the models are fixed and the extension is off.
        unavailable: repository models that failed to load, each with why.

    Example:
        >>> import uvicorn  # doctest: +SKIP
        >>> uvicorn.run(create_app([load_model("runs/gpt-1")]), port=8000)  # doctest: +SKIP
    """
    server = _Server(models, options or ServeOptions(), repository, unavailable)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        server.start()
        try:
            yield
        finally:
            server.stop()

    model_routes = []
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        model_routes += [
            Route(prefix, server.model_metadata, methods=["GET"]),
            Route(prefix + "/ready", server.model_ready, methods=["GET"]),
            Route(prefix + "/config", server.model_config, methods=["GET"]),
            Route(prefix + "/infer", server.infer, methods=["POST"]),
        ]
    routes = [
        Route("/v2/health/live", server.live, methods=["GET"]),
        Route("/v2/health/ready", server.ready, methods=["GET"]),
        Route("/v2", server.server_metadata, methods=["GET"]),
        Route("/v2/repository/index", server.repository_index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", server.load, methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", server.unload, methods=["POST"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        *model_routes,
    ]

    async def protocol_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProtocolError)
        response = _error(str(exc), exc.status)
        if exc.status in (429, 503):
            response.headers["Retry-After"] = "1"
        return response

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        detail = exc.detail
        if exc.status_code == 404:
            detail = (f"no endpoint {request.method} {request.url.path}. See /v2 and "
                      "/v2/models/{name}.")
        elif exc.status_code == 405:  # Starlette's exception carries the Allow header
            detail = (f"{request.url.path} does not take {request.method}; it takes "
                      f"{(exc.headers or {}).get('Allow', '?')}.")
        return _error(str(detail), exc.status_code, exc.headers)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(f"internal server error ({type(exc).__name__}: {exc}). This is a bug "
                      "in gpufleet serve: please report it with the request.", 500)

    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(_SameWithTrailingSlash)],
                    exception_handlers={ProtocolError: protocol_error, HTTPException: http_error,
                                        Exception: internal_error})
    app.router.redirect_slashes = False  # a trailing slash is the same path, not a 307
    app.state.server = server
    return app


class _SameWithTrailingSlash:
    """ASGI wrapper: ``/v2/`` is ``/v2`` (the protocol's REST spec writes the server
    metadata path with the slash), and so for every path; no redirect."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            trimmed = path.rstrip("/") or "/"
            scope = {**scope, "path": trimmed, "raw_path": trimmed.encode()}
        await self.app(scope, receive, send)
