"""Checks of a LoRAAdapter against its pool that need no engine: rank, targets, source confinement.

The engine repeats them (and checks what only the files tell: real rank, shapes, base model, where symlinks
lead); checking here first gives a clear reason without touching any pod, and keeps a bad manifest from reaching
a pod at all. The source rules are the contract's (`kubelora.contract.sources`), so both sides agree.
"""

from __future__ import annotations

from kubelora.contract.load import S3Access
from kubelora.contract.sources import SourceKind, SourceNotAllowed, SourceRules, check_source
from kubelora.operator.specs import AdapterSource, AdapterSpec, InvalidSpec, PoolSpec
from kubelora.operator.status import Failure

# The modules spec.targets may name (the CRD's enum): the projections, Phi-3's fused ones, and the embedding and
# lm_head. The engine reports a fused module's adapter as the projections it spans, so the declared targets are
# compared in those terms.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SUPPORTED_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                               "embed_tokens", "lm_head", *FUSED_TARGETS})


def validate_adapter(adapter: AdapterSpec, pool: PoolSpec) -> None:
    """Raise InvalidSpec (with a CamelCase reason) when `adapter` cannot be served by `pool`."""
    if adapter.rank is not None and adapter.rank > pool.engine.max_lora_rank:
        raise InvalidSpec("RankTooHigh", f"spec.rank {adapter.rank} exceeds the pool's engine.maxLoraRank "
                                         f"{pool.engine.max_lora_rank}")
    unsupported = sorted(set(adapter.targets) - SUPPORTED_TARGETS)
    if unsupported:
        raise InvalidSpec("TargetUnsupported", f"spec.targets {unsupported} are not supported; allowed: "
                                               f"{sorted(SUPPORTED_TARGETS)}")
    check_source_allowed(adapter.source, pool)


RANK_MISMATCH, TARGETS_MISMATCH = "RankMismatch", "TargetsMismatch"
DECLARED_MISMATCHES = frozenset({RANK_MISMATCH, TARGETS_MISMATCH})


def check_declared(name: str, declared_rank: int | None, declared_targets: tuple[str, ...], rank: int | None,
                   targets: tuple[str, ...] | None, where: str) -> Failure | None:
    """A declared spec.rank or spec.targets that the adapter files (as the engine read them) contradict.

    The engine reports each adapter's rank (its largest module rank) and the modules it adapts; what it does not
    report is not checked. `where` names the pod that reported it."""
    if declared_rank is not None and rank is not None and declared_rank != rank:
        return Failure(RANK_MISMATCH, f"spec.rank is {declared_rank} but the files of {name!r} have rank {rank} "
                                      f"({where})")
    if declared_targets and targets is not None and _unfused(declared_targets) != _unfused(targets):
        return Failure(TARGETS_MISMATCH, f"spec.targets is {sorted(declared_targets)} but the files of {name!r} "
                                         f"adapt {sorted(targets)} ({where})")
    return None


def _unfused(targets: tuple[str, ...]) -> set[str]:
    return {part for target in targets for part in FUSED_TARGETS.get(target, (target,))}


# The pool field of each contract rule, named in refusals.
RULE_FIELDS = {"roots": "adapterRoots", "url_hosts": "adapterUrlHosts", "s3_buckets": "adapterS3Buckets",
               "s3_endpoints": "adapterS3Endpoints"}


def check_source_allowed(source: AdapterSource, pool: PoolSpec) -> None:
    """The contract's source rules (`kubelora.contract.sources`), the engine's too, over the pool's lists."""
    rules = SourceRules(pool.adapter_roots, pool.adapter_url_hosts, pool.adapter_s3_buckets, pool.adapter_s3_endpoints)
    try:
        if source.is_s3:
            S3Access(endpoint=source.s3_endpoint, region=source.s3_region)
        checked = check_source(rules, source.lora_path, s3_endpoint=source.s3_endpoint)
    except ValueError as exc:  # spec.source.s3's endpoint or region
        raise InvalidSpec("UrlNotAllowed", f"spec.source.s3: {exc}") from None
    except SourceNotAllowed as exc:
        reason = "PathNotAllowed" if exc.code == "path_not_allowed" else "UrlNotAllowed"
        named = f" (the pool's spec.{RULE_FIELDS[exc.rule]})" if exc.rule is not None else ""
        raise InvalidSpec(reason, f"spec.source: {exc.message}{named}") from None
    if (source.path is not None) != (checked.kind is SourceKind.LOCAL):
        raise InvalidSpec("PathNotAllowed" if source.path is not None else "UrlNotAllowed",
                          "spec.source.path takes a local path and spec.source.url an http(s) or s3 URL")
