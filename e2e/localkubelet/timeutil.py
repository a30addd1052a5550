"""Kubernetes time formats."""
from __future__ import annotations

import datetime


def now_rfc3339() -> str:
    """metav1.Time: second precision, UTC."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """metav1.MicroTime, used by Leases."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
