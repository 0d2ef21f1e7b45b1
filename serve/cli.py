"""infer.py's --serve: its flags, their checks (before anything loads), and the server started on the loaded engine.

Importable without torch or the server stack, so that --help and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

USAGE_EXIT = 2  # infer.py's exit status for bad flags or input
DEFAULT_HOST, DEFAULT_PORT, DEFAULT_QUEUE = "127.0.0.1", 8080, 16
KEY_VARIABLE = "SPECCHAT_API_KEY"  # where the key may come from instead of the command line, which `ps` shows


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server (OpenAI-compatible API)")
    group.add_argument("--serve", action="store_true",
                       help="serve the models over HTTP instead of chatting: /v1/chat/completions, /v1/completions "
                            "(streamed or not), /v1/models, /health; a request's \"specchat\" object picks the "
                            "strategy and its settings (default: the first --strategy); the decoding flags are "
                            "the defaults a request overrides")
    group.add_argument("--host", default=DEFAULT_HOST,
                       help="the address to listen on (default: this machine only; 0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help="the port to listen on (0: any free one)")
    group.add_argument("--api-key", metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on every request but /health (default: "
                            f"${KEY_VARIABLE}, else none)")
    group.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE, metavar="N",
                       help="requests that may wait behind the one generating; more get a 503 with Retry-After")


def check_server_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the server flags, as one line; None if nothing is."""
    serving_only = [flag for flag, given in (("--host", args.host != DEFAULT_HOST),
                                             ("--port", args.port != DEFAULT_PORT),
                                             ("--api-key", args.api_key is not None),
                                             ("--queue-size", args.queue_size != DEFAULT_QUEUE)) if given]
    if not args.serve:
        return f"{serving_only[0]} needs --serve" if serving_only else None
    others = [flag for flag, given in (("--prompt", args.prompt is not None), ("--prompt-file", args.prompt_file
                                       is not None), ("--json", args.json), ("--export", args.export is not None))
              if given]
    if others:
        return f"--serve answers requests, not {others[0]}: drop one of them"
    if not 0 <= args.port <= 65535:
        return f"--port must be from 0 to 65535, got {args.port}"
    if args.queue_size < 1:
        return f"--queue-size must be at least 1, got {args.queue_size}"
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key is empty"
    return None


def serve_engine(engine: Any, args: argparse.Namespace, strategy: str, errors: Console) -> int:
    """Serve `engine` as the flags say until Ctrl-C; `strategy` when a request names none. Returns the exit status:
    0, or USAGE_EXIT where the address cannot be listened on."""
    from serve.app import ServeConfig, create_app
    from serve.server import bind, exposure_warning, run, url

    key = args.api_key or os.environ.get(KEY_VARIABLE) or None
    defaults = {name: value for name, value in (("max_new_tokens", args.max_new_tokens),
                                                ("temperature", args.temperature), ("top_k", args.top_k),
                                                ("top_p", args.top_p), ("min_p", args.min_p), ("seed", args.seed),
                                                ("ignore_eos", args.ignore_eos or None)) if value is not None}
    config = ServeConfig(model_name=engine.info.target_spec or engine.info.target, strategy=strategy,
                         defaults=defaults, system=args.system, queue_size=args.queue_size, api_key=key)
    if (warning := exposure_warning(args.host, key is not None)) is not None:
        errors.print(f"infer.py: warning: {warning}", style="yellow", markup=False, soft_wrap=True)
    try:
        sock = bind(args.host, args.port)
    except OSError as error:
        errors.print(f"infer.py: error: cannot listen on {args.host} port {args.port} "
                     f"({error.strerror or error}): pass another --port or --host", style="red", markup=False,
                     soft_wrap=True)
        return USAGE_EXIT
    errors.print(f"serving {config.model_name} on {url(args.host, sock.getsockname()[1])}/v1 (strategy {strategy} "
                 "unless a request names another; Ctrl-C stops)", markup=False, soft_wrap=True)
    run(create_app(engine, config), sock)
    return 0
