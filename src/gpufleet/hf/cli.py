"""``gpufleet tokens add MODEL_DIR OUT_DIR --token ...``: new tokens for a Transformers model.

Imports only the standard library at the top (``gpufleet --help`` stays fast, and a
machine without Transformers gets the install hint instead of a traceback).
"""

from __future__ import annotations

import argparse

from gpufleet.hf import require_transformers

EPILOG = """\
initialisation of the new rows (--init, once for every token or once per --token, in order):
  random              what resize_token_embeddings draws (the library default)
  zeros               all zeros
  copy:TOKEN          a copy of an existing token's row, e.g. copy:[SEP]
  mean:DESCRIPTION    the mean of the rows of the description's sub-tokens
  mean-all            the mean of all existing rows

examples:
  gpufleet tokens add models/minilm models/minilm-ent --special \\
      --token '[ENT_START]' --init 'mean:start of an entity' \\
      --token '[ENT_END]' --init 'mean:end of an entity'
  gpufleet tokens add models/gpt2 out --token covid --token mRNA --init mean-all
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet tokens`` (with its ``add`` subcommand) to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["tokens", "add", "in", "out", "--token", "[E]"]).token
        ['[E]']
    """
    tokens = sub.add_parser(
        "tokens", help="add tokens to a Transformers model (resize and initialise embeddings)",
        description="Change the vocabulary of a Hugging Face Transformers model folder.")
    actions = tokens.add_subparsers(dest="tokens_action", metavar="ACTION", required=True)
    add = actions.add_parser(
        "add", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        help="add tokens, resize the embeddings, initialise the new rows, save",
        description="Add tokens to the tokenizer of MODEL_DIR, resize the model's input "
                    "embeddings and its output layer (tied or untied), initialise the new "
                    "rows, and save tokenizer and model together into OUT_DIR. Tokens the "
                    "tokenizer already has are skipped and listed.")
    add.add_argument("model_dir", metavar="MODEL_DIR", help="model folder to read")
    add.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the result to")
    add.add_argument("--token", action="append", required=True, metavar="TEXT",
                     help="a token to add (repeat for several)")
    add.add_argument("--special", action="store_true",
                     help="add them as special tokens (never split or lower-cased)")
    add.add_argument("--init", action="append", metavar="STRATEGY",
                     help="how to initialise the new rows (default random; see below)")
    add.add_argument("--sample", metavar="TEXT",
                     help="sentence to tokenize before and after (default: one using the "
                          "tokens)")
    add.add_argument("--model-class", metavar="NAME",
                     help="Transformers class to load with (default: the saved architecture, "
                          "e.g. BertForMaskedLM; else AutoModel)")


def run(args: argparse.Namespace) -> int:
    """Run ``gpufleet tokens add``; returns the exit code (errors raise GpufleetError)."""
    from gpufleet.hf.vocab import InitSpec

    inits = args.init or ["random"]
    for text in inits:  # a typo fails here, before Transformers and the model are loaded
        InitSpec.parse(text)
    from gpufleet.hf.models import check_model_folder, extend_vocabulary

    check_model_folder(args.model_dir)
    require_transformers("gpufleet tokens")
    result = extend_vocabulary(args.model_dir, args.out_dir, args.token, special=args.special,
                               init=inits, sample=args.sample, auto_class=args.model_class)
    for token, reason in result.skipped.items():
        print(f"skipped {token!r}: {reason}")
    if result.added:
        kind = "special tokens" if args.special else "tokens"
        print(f"added {len(result.added)} {kind}:")
        for token, new_id in result.added.items():
            print(f"  {token!r} id {new_id}, init {result.inits[token]}")
    else:
        print("nothing added: every token is already in the vocabulary")
    print(f"vocabulary size: {result.old_vocab_size} -> {result.new_vocab_size}")
    print(f"embedding rows: {result.old_rows} -> {result.new_rows} "
          f"(output layer: {result.output_layer})")
    print(f"sample: {result.sample}")
    print(f"  before ({len(result.sample_before)} tokens): {' '.join(result.sample_before)}")
    print(f"  after  ({len(result.sample_after)} tokens): {' '.join(result.sample_after)}")
    print(f"saved tokenizer and model to {args.out_dir}")
    return 0
