"""``gpufleet serve``: answer KServe v2 / Triton HTTP requests for a model.

Imports only the standard library at the top; the server stack loads inside ``run``.
"""

from __future__ import annotations

import argparse

from gpufleet.errors import ConfigError

EPILOG = """\
MODEL is one of:
  a model repository       a directory of model folders (Triton model directories or run
                           directories), as `gpufleet export triton` writes; every model
                           loads at start, and clients load/unload them by name
  a run directory          config.toml + checkpoints/ from `gpufleet train`; the newest
                           checkpoint is served, inputs are read off the run's own data
  a Triton model directory config.pbtxt + 1/model.pt, as `gpufleet export triton` writes
  a TorchScript file       from torch.jit.save; needs --input
  package.module:function  a factory returning an nn.Module or a numpy callable; needs --input

examples:
  gpufleet serve runs/gpt-stdlib-20260101-120000
  gpufleet serve runs/gpt-stdlib-20260101-120000 --port 8000 --max-batch-size 32 \\
      --max-queue-delay-us 2000
  gpufleet serve model.pt --input x:FP32:8 --model-name mlp
  gpufleet serve mypkg.nets:build --input tokens:INT64:-1
  gpufleet serve model_repository      # all its models; POST /v2/repository/models/NAME/load

clients: the official tritonclient works unchanged, e.g.
  tritonclient.http.InferenceServerClient("127.0.0.1:8000").infer("gpt-stdlib", [...])
endpoints: /v2/health/live, /v2/health/ready, /v2, /v2/models/NAME[/versions/V][/ready],
  POST /v2/models/NAME/infer (JSON or binary tensor data), /metrics (Prometheus);
  with a repository: POST /v2/repository/index, /v2/repository/models/NAME/load|unload
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet serve`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["serve", "runs/x", "--port", "0"]).port
        0
    """
    p = sub.add_parser("serve", help="serve a model over the KServe v2 / Triton HTTP protocol",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Serve a trained run (or a TorchScript file or factory) "
                                   "over the KServe v2 / Triton HTTP protocol, with dynamic "
                                   "batching and Prometheus metrics.",
                       epilog=EPILOG)
    p.add_argument("model", metavar="RUN_DIR|MODEL", help="what to serve (see below)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    add_batching_args(p, default_batch=8, default_delay=1000)
    p.add_argument("--max-body-bytes", type=int, default=64 * 2**20, metavar="N",
                   help="larger request bodies get 413 (default 64 MiB)")
    p.add_argument("--max-inflight-bytes", type=int, default=256 * 2**20, metavar="N",
                   help="bytes of all requests being handled at once; past it requests get "
                        "429 with Retry-After (default 256 MiB)")
    p.add_argument("--model-name", metavar="NAME", help="name clients use (default: the "
                   "run's name, or the file/factory name)")
    add_input_arg(p)
    add_trust_code_arg(p)
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def add_batching_args(p: argparse.ArgumentParser, default_batch: int,
                      default_delay: int) -> None:
    p.add_argument("--max-batch-size", type=int, default=default_batch, metavar="N",
                   help=f"most samples merged into one model call; 1 turns dynamic batching "
                        f"off (default {default_batch})")
    p.add_argument("--max-queue-delay-us", type=int, default=default_delay, metavar="US",
                   help="longest the oldest queued request waits for others to join, in "
                        f"microseconds (default {default_delay})")


def add_trust_code_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-code", action="store_true",
                   help="import and call the model/data factory a run directory's "
                        "config.toml names (not needed for the built-in gpt model). Only for "
                        "run directories you trust: the factory runs as you")


def add_input_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", action="append", default=[], metavar="NAME:DTYPE:DIMS",
                   help="one model input, in call order: dims without the batch dim, -1 for "
                        "any size, e.g. x:FP32:8 or tokens:INT64:-1 (repeat per input)")


def run(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
    import logging

    from gpufleet.serve.app import ServeOptions, create_app
    from gpufleet.serve.model import load_model
    from gpufleet.serve.repository import ModelRepository, is_repository
    from gpufleet.serve.runner import bind, make_server, url_of
    from gpufleet.serve.trim import fix_mmap_threshold

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        options = ServeOptions(args.max_batch_size, args.max_queue_delay_us,
                               args.max_body_bytes, args.max_inflight_bytes)
    except ValueError as e:
        raise ConfigError(f"{e} Fix the --max-* option.") from None
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a TCP port. Pick one from 1 to 65535 "
                          "(0: any free port).")
    repository, unavailable = None, {}
    if is_repository(args.model):
        if args.model_name or args.input:
            raise ConfigError(f"{args.model!r} is a model repository: each model is named "
                              "after its folder and described by its own files. Drop "
                              "--model-name and --input, or serve one folder of it.")
        repository = ModelRepository(args.model, device=args.device,
                                     trust_code=args.trust_code)
        models, unavailable = repository.load_all()
    else:
        models = [load_model(args.model, name=args.model_name, inputs=args.input,
                             device=args.device, trust_code=args.trust_code)]
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port} ({e}). Pick another "
                          "--port (0: any free port) or --host.") from None
    fix_mmap_threshold()  # this process only serves: large buffers go back when freed
    server = make_server(create_app(models, options, repository, unavailable),
                         log_level=args.log_level)
    url = url_of(sock)
    what = (f"model repository {args.model!r} ({len(models)} loaded: "
            f"{', '.join(m.name for m in models) or 'none'})" if repository
            else f"model {models[0].name!r}")
    print(f"serving {what} at {url} (v2 protocol; metrics at {url}/metrics; "
          f"max batch {options.max_batch_size}, queue delay {options.max_queue_delay_us} us)",
          flush=True)
    for name, why in unavailable.items():
        print(f"model {name!r} is not available: {why}", flush=True)
    try:
        server.run(sockets=[sock])  # until Ctrl-C / SIGTERM; the queued requests finish
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after shutdown
        pass
    return 0
