"""kubelora data plane: model, scheduler, adapters, OpenAI-compatible server."""
