"""kubelora control plane (kopf). Imported only as `kubelora.operator`."""

if __name__ != "kubelora.operator":
    # Importing this folder as top-level `operator` would shadow the standard library's module.
    raise ImportError(f"kubelora's operator package must be imported as kubelora.operator, not {__name__}")
