"""The `kubelora` command line."""
