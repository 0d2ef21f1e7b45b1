"""An OpenAI-compatible HTTP server over one `app.Engine`: /v1/chat/completions, /v1/completions, /v1/models and
/health, with llama.cpp's `timings` in every answer and a `specchat` extension object that picks the strategy.

    app = create_app(engine, ServeConfig(model_name="smollm2-135m"))
    run(app, "127.0.0.1", 8080, print)     # or: with Background(app) as server: ... server.url

The names are looked up on first use, so that infer.py's flags (serve.cli) load without the server stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve.app import ServeConfig, create_app
    from serve.server import Background, run

__all__ = ["Background", "ServeConfig", "create_app", "run"]


def __getattr__(name: str):
    if name in ("ServeConfig", "create_app"):
        from serve import app

        return getattr(app, name)
    if name in ("Background", "run"):
        from serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'serve' has no attribute {name!r}")
