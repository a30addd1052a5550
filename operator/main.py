"""`kopf run -m kubelora.operator.main`: importing this module registers every handler."""

from kubelora.operator import handlers  # noqa: F401  (registration by import)
