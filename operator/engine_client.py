"""The engine's admin API over HTTP (docs/server.md): list, load, unload. One client per reconcile.

Every call goes to a pod's admin port (`observe.pod_admin_url`) with the pool's admin token: with a token
configured the engine answers nothing there without it, and its serving port has no admin endpoints.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from kubelora.contract.load import LoadRequest
from kubelora.operator.plan import DesiredAdapter, ObservedAdapter


class EngineError(Exception):
    """A failed engine call. `is_permanent`: a 400 about the adapter itself that retrying cannot help.

    `is_retryable`: the engine's own word on a failed load (the error body's `retryable`, None when absent): a
    source that is not there yet, a network failure or HTTP 404/5xx from the source is retryable; corrupt files,
    a shape or rank mismatch, a refused path or host are not.
    """

    def __init__(self, status: int | None, code: str | None, message: str, is_retryable: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.is_retryable = is_retryable

    @property
    def is_permanent(self) -> bool:
        # 401 (token), 404/409 (races with unload or another revision), 429 and 5xx heal on retry; so does a 400
        # the engine calls retryable. A 400 without `retryable` is not a load error (a malformed request): permanent.
        return self.status == 400 and self.is_retryable is not True

    @property
    def reason(self) -> str:
        """CamelCase condition reason from the engine's error code (adapter_rank_too_large -> AdapterRankTooLarge)."""
        if self.code:
            return "".join(part.capitalize() for part in self.code.split("_"))
        return "EngineUnavailable" if self.status is None else f"EngineHttp{self.status}"


@dataclass(frozen=True)
class ModelList:
    """What an engine's admin list says: its adapters, its device adapter pool budget in bytes (None: it does not
    say) and the fingerprint of the API key table it holds (None: none)."""
    adapters: dict[str, ObservedAdapter]
    budget: int | None = None
    api_keys_fingerprint: str | None = None


@dataclass(frozen=True)
class LoadResult:
    card: dict
    was_loaded: bool


class EngineClient:
    def __init__(self, session: aiohttp.ClientSession, admin_token: str | None, timeout_s: float) -> None:
        self._session = session
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def list_adapters(self, base_url: str) -> dict[str, ObservedAdapter]:
        return (await self.list_models(base_url)).adapters

    async def list_models(self, base_url: str) -> ModelList:
        body, _ = await self._call_tagged("GET", f"{base_url}/v1/models", None)
        cards = body.get("data", [])
        base = next((c for c in cards if c.get("parent") is None), {})
        budget, keys = base.get("adapter_pool_bytes"), base.get("api_keys") or {}
        adapters = {card["id"]: ObservedAdapter.from_card(card) for card in cards if card.get("parent") is not None}
        return ModelList(adapters, budget if isinstance(budget, int) and budget > 0 else None,
                         keys.get("fingerprint") if isinstance(keys.get("fingerprint"), str) else None)

    async def put_api_keys(self, base_url: str, table: dict) -> None:
        """Replace the engine's API key table (digests only; kubelora.contract.keys)."""
        await self._call("PUT", f"{base_url}/v1/api_keys", {"apiKeys": table})

    async def wait_for_change(self, base_url: str, tag: str | None, wait_s: float) -> str | None:
        """The pod's adapter-set tag once it differs from `tag` (at once when `tag` is None), or after `wait_s`
        with the same one; None when the engine tags nothing (it cannot be watched)."""
        query = "" if tag is None else f"?changed_since={tag}&wait_s={wait_s:g}"
        # Only the tag is read: the model list (about 1 MB at 2,000 adapters) is not parsed unless it is an error
        _, etag = await self._call_tagged("GET", f"{base_url}/v1/models{query}", None,
                                          timeout=aiohttp.ClientTimeout(total=wait_s + 10), is_tag_only=True)
        return etag.strip('"') if etag else None

    async def load(self, base_url: str, adapter: DesiredAdapter, *, is_preload: bool, is_inplace: bool) -> LoadResult:
        payload = LoadRequest(adapter.name, adapter.lora_path, is_inplace, is_preload, adapter.sha256,
                              adapter.auth_token, adapter.s3).as_payload()
        body = await self._call("POST", f"{base_url}/v1/load_lora_adapter", payload)
        return LoadResult(card=body.get("adapter") or {}, was_loaded=bool(body.get("was_loaded")))

    async def unload(self, base_url: str, name: str) -> bool:
        body = await self._call("POST", f"{base_url}/v1/unload_lora_adapter", {"lora_name": name})
        return bool(body.get("was_loaded", True))

    async def _call(self, method: str, url: str, payload: dict | None) -> dict:
        return (await self._call_tagged(method, url, payload))[0]

    async def _call_tagged(self, method: str, url: str, payload: dict | None,
                           timeout: aiohttp.ClientTimeout | None = None,
                           is_tag_only: bool = False) -> tuple[dict, str | None]:
        """The JSON body and the ETag header; is_tag_only: a successful answer's body is read but not parsed."""
        try:
            async with self._session.request(method, url, json=payload, headers=self._headers,
                                             timeout=timeout or self._timeout) as response:
                if is_tag_only and response.status < 400:
                    await response.read()
                    return {}, response.headers.get("ETag")
                body = await response.json(content_type=None)
                if response.status >= 400:
                    error = (body or {}).get("error") or {}
                    retryable = error.get("retryable")
                    raise EngineError(response.status, error.get("code") or error.get("type"),
                                      error.get("message") or f"HTTP {response.status}",
                                      retryable if isinstance(retryable, bool) else None)
                return body or {}, response.headers.get("ETag")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise EngineError(None, None, f"{method} {url}: {type(exc).__name__}: {exc}") from exc
