"""A local-directory PersistentVolume provisioner (`python -m localkubelet.provisioner`).

Installs StorageClass `local` (the default) and, for each pending claim of that class,
creates a hostPath PersistentVolume pre-bound to it under --root-dir; the controller-manager's
PV controller completes the binding. Released volumes are deleted with their directory.
Runs with admin credentials: creating PVs is cluster-scoped, beyond a node's rights.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import threading
from pathlib import Path

from .apiclient import ApiClient, ApiError, TlsIdentity

STORAGE_CLASS = "local"
PROVISIONER = "kubelora.local/local-dir"
POLL_S = 1.0
log = logging.getLogger("provisioner")


def build_storage_class() -> dict:
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS, "annotations": {
                "storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": PROVISIONER, "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate"}


def build_volume(claim: dict, root: Path) -> dict:
    meta, spec = claim["metadata"], claim["spec"]
    name = f"pvc-{meta['uid']}"
    return {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "annotations": {
                "pv.kubernetes.io/provisioned-by": PROVISIONER}},
            "spec": {"capacity": {"storage": spec["resources"]["requests"]["storage"]},
                     "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
                     "persistentVolumeReclaimPolicy": "Delete",
                     "storageClassName": STORAGE_CLASS,
                     "hostPath": {"path": str(root / name), "type": "DirectoryOrCreate"},
                     "claimRef": {"namespace": meta["namespace"], "name": meta["name"],
                                  "uid": meta["uid"]}}}


def wants_volume(claim: dict) -> bool:
    spec = claim["spec"]
    return (claim.get("status", {}).get("phase") == "Pending" and not spec.get("volumeName")
            and spec.get("storageClassName") == STORAGE_CLASS)


def sync_once(api: ApiClient, root: Path) -> None:
    for claim in api.get("/api/v1/persistentvolumeclaims")["items"]:
        if wants_volume(claim):
            volume = build_volume(claim, root)
            Path(volume["spec"]["hostPath"]["path"]).mkdir(parents=True, exist_ok=True)
            create_ignoring_conflict(api, "/api/v1/persistentvolumes", volume)
    for volume in api.get("/api/v1/persistentvolumes")["items"]:
        annotations = volume["metadata"].get("annotations", {})
        if annotations.get("pv.kubernetes.io/provisioned-by") == PROVISIONER and \
                volume.get("status", {}).get("phase") == "Released":
            api.delete(f"/api/v1/persistentvolumes/{volume['metadata']['name']}")
            shutil.rmtree(volume["spec"]["hostPath"]["path"], ignore_errors=True)


def create_ignoring_conflict(api: ApiClient, path: str, body: dict) -> None:
    try:
        api.post(path, body)
    except ApiError as error:
        if error.status != 409:
            raise


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="localkubelet.provisioner")
    for flag in ("server", "ca", "client-cert", "client-key", "root-dir"):
        parser.add_argument(f"--{flag}", required=True)
    args = parser.parse_args()
    api = ApiClient(args.server, TlsIdentity(args.ca, args.client_cert, args.client_key))
    root = Path(args.root_dir)
    create_ignoring_conflict(api, "/apis/storage.k8s.io/v1/storageclasses", build_storage_class())
    stop = threading.Event()
    while not stop.wait(POLL_S):
        try:
            sync_once(api, root)
        except (ApiError, OSError) as error:
            log.warning("provisioner sync failed: %s", error)


if __name__ == "__main__":
    main()
