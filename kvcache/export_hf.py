"""`kvcache export-hf OUT_DIR`: write a model as a Hugging Face folder that vLLM and transformers
load (config.json, float32 model.safetensors, tokenizer.json, tokenizer_config.json with the chat
template, generation_config.json), the same weights, tokenizer and template kvcache runs.
Exports the Llama family: a named model (default smollm2-135m) or a .gguf file."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from worker.model.named import DEFAULT_MODEL

    parser.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (created; must be missing or empty)")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_OR_GGUF",
                        help=f"a named model or a .gguf file (default {DEFAULT_MODEL})")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it already holds a model folder")


def run(args: argparse.Namespace) -> int:
    from worker.model.config import CheckpointError
    from worker.model.hf_export import export_hf_folder

    try:
        folder = export_hf_folder(args.model, args.out_dir, force=args.force)
    except (CheckpointError, OSError) as exc:
        print(f"kvcache export-hf: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {folder}: {args.model} as a Hugging Face folder (float32 weights)")
    return 0
