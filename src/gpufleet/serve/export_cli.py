"""``gpufleet export triton RUN_DIR OUT_DIR``: write a Triton model repository;
``gpufleet export hf RUN_DIR OUT_DIR``: a Transformers ``save_pretrained`` folder.

Imports only the standard library at the top; torch loads inside ``run``.
"""

from __future__ import annotations

import argparse

from gpufleet.serve.cli import add_batching_args, add_input_arg, add_trust_code_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet export`` (with its ``triton`` format) to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["export", "triton", "runs/x", "repo"]).out_dir
        'repo'
    """
    p = sub.add_parser("export", help="export a trained model (Triton model repository, "
                                      "Transformers folder)",
                       description="Export a trained model for serving elsewhere.")
    formats = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    t = formats.add_parser(
        "triton", help="a Triton model repository (TorchScript + config.pbtxt)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write OUT_DIR/<model>/config.pbtxt and OUT_DIR/<model>/1/model.pt "
                    "(TorchScript, for Triton's pytorch_libtorch backend) with the inputs "
                    "and outputs, max_batch_size and a dynamic_batching block.",
        epilog="examples:\n"
               "  gpufleet export triton runs/gpt-stdlib-20260101-120000 model_repository\n"
               "  tritonserver --model-repository=model_repository   # then serve it\n"
               "  gpufleet serve model_repository/gpt-stdlib         # or serve it here")
    t.add_argument("source", metavar="RUN_DIR", help="a run directory (or a factory "
                   "package.module:function / TorchScript file with --input)")
    t.add_argument("out_dir", metavar="OUT_DIR", help="the model repository to write into")
    t.add_argument("--model-name", metavar="NAME", help="model name (default: the run's name)")
    add_batching_args(t, default_batch=8, default_delay=100)
    add_input_arg(t)
    add_trust_code_arg(t)
    h = formats.add_parser(
        "hf", help="a Transformers save_pretrained folder (weights + tokenizer)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write the run's trained weights (newest intact checkpoint) and the "
                    "tokenizer as a save_pretrained folder that from_pretrained loads. "
                    "Nothing named in the run's config is imported or run.",
        epilog="examples:\n"
               "  gpufleet export hf runs/entity-markers-20260101-120000 out/minilm-tuned\n"
               "  gpufleet export hf runs/mymodel-1 out --base models/minilm   # own factory")
    h.add_argument("source", metavar="RUN_DIR", help="the run directory")
    h.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write")
    h.add_argument("--base", metavar="FOLDER", help="the model folder the run started from "
                   "(default: model.kwargs.path of a gpufleet.hf:pretrained run)")
    h.add_argument("--tokenizer", metavar="FOLDER", help="take the tokenizer from here "
                   "(default: the base folder)")
    h.add_argument("--class", dest="class_name", metavar="NAME", help="the Transformers "
                   "class to export as, e.g. BertModel or AutoModelForSequenceClassification "
                   "(default: the class the run trained, else the base folder's)")


def run(args: argparse.Namespace) -> int:
    """Export and print where the repository was written."""
    if args.format == "hf":
        return _run_hf(args)
    from gpufleet.errors import ConfigError
    from gpufleet.serve.export import export_triton, load_for_export
    from gpufleet.serve.model import load_model

    if args.max_batch_size < 1 or args.max_queue_delay_us < 0:
        raise ConfigError(f"--max-batch-size {args.max_batch_size} / --max-queue-delay-us "
                          f"{args.max_queue_delay_us}: the batch size must be >= 1 and the "
                          "delay >= 0.")
    if args.input:
        model = load_model(args.source, name=args.model_name, inputs=args.input, device="cpu",
                           trust_code=args.trust_code)
    else:
        model = load_for_export(args.source, name=args.model_name, trust_code=args.trust_code)
    folder = export_triton(model, args.out_dir, args.max_batch_size, args.max_queue_delay_us)
    print(f"wrote Triton model {model.name!r} to {folder} "
          f"(config.pbtxt, 1/model.pt); serve it with "
          f"tritonserver --model-repository={args.out_dir}")
    return 0


def _run_hf(args: argparse.Namespace) -> int:
    from gpufleet.hf import require_transformers

    require_transformers("gpufleet export hf")
    from gpufleet.hf.export import export_pretrained

    out = export_pretrained(args.source, args.out_dir, base=args.base, tokenizer=args.tokenizer,
                            class_name=args.class_name)
    if not (out / "tokenizer_config.json").is_file():
        print(f"wrote the trained model to {out} (no tokenizer: pass --tokenizer FOLDER to "
              f"add one); load it with AutoModel*.from_pretrained({str(out)!r})")
        return 0
    print(f"wrote the trained model and its tokenizer to {out}; load them with "
          f"AutoModel*.from_pretrained({str(out)!r}) and AutoTokenizer.from_pretrained(...)")
    return 0
