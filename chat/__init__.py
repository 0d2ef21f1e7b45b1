"""The terminal chat app: session (history, KV reuse), commands (dispatch table), rendering, one-shot mode."""
